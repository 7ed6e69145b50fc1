"""``python merge_constraints.py BASE OVERRIDES > OUT``: BASE's ``name==version`` lines with the packages that
OVERRIDES pins replaced by its lines (names compared as PEP 503 normalises them), OVERRIDES' other pins appended.

pip refuses two constraint files that pin one package differently, so the runtime image gets one merged file.
An override that pins a package to the version BASE already has is an error (a stale override)."""

from __future__ import annotations

import re
import sys


def pins(path: str) -> dict[str, str]:
    found: dict[str, str] = {}
    with open(path) as f:
        for number, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[^\s=]+", line):
                raise SystemExit(f"{path}:{number}: not a 'name==version' pin: {line!r}")
            name = re.sub(r"[-_.]+", "-", line.split("==")[0]).lower()
            found[name] = line
    return found


def main(base_path: str, overrides_path: str) -> int:
    base, overrides = pins(base_path), pins(overrides_path)
    stale = [line for name, line in overrides.items() if base.get(name) == line]
    if stale:
        raise SystemExit(f"{overrides_path}: already pinned so in {base_path}: {', '.join(stale)}")
    merged = {**base, **overrides}
    sys.stdout.write("".join(f"{line}\n" for line in merged.values()))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.splitlines()[0])
    sys.exit(main(sys.argv[1], sys.argv[2]))
