"""Compare two directories of compiled pipeline IR (``python -m pipelines.compile --output-dir DIR``).

    python scripts/compare_ir.py BEFORE_DIR AFTER_DIR

KFP embeds each lightweight component's Python source in its executor's ``command``, so a refactor that changes
a component body changes the IR there and nowhere else.  This prints, per pipeline file, whether the documents are
byte-identical; where they are not, whether they are identical once every executor's embedded source is set aside,
and a unified diff of the sources that changed.  Exit status 1 when anything other than embedded sources differs.
"""

from __future__ import annotations

import copy
import difflib
import sys
from pathlib import Path
from typing import Any

import yaml


def split_sources(doc: Any) -> tuple[Any, dict[str, str]]:
    """The document with every executor's ``command`` replaced by a marker, and those commands by executor name."""
    doc = copy.deepcopy(doc)
    sources: dict[str, str] = {}
    executors = (doc.get("deploymentSpec") or {}).get("executors") or {} if isinstance(doc, dict) else {}
    for name, executor in executors.items():
        container = executor.get("container") or {}
        if "command" in container:
            sources[name] = "\n".join(container["command"])
            container["command"] = ["<embedded source>"]
    return doc, sources


def main(before: Path, after: Path) -> int:
    names = sorted({p.name for p in before.glob("*.yaml")} | {p.name for p in after.glob("*.yaml")})
    structural = 0
    for name in names:
        a, b = before / name, after / name
        if not (a.is_file() and b.is_file()):
            print(f"{name}: only in {'the first' if a.is_file() else 'the second'} directory")
            structural += 1
            continue
        if a.read_bytes() == b.read_bytes():
            print(f"{name}: byte-identical")
            continue
        docs_a = list(yaml.safe_load_all(a.read_text()))
        docs_b = list(yaml.safe_load_all(b.read_text()))
        split_a = [split_sources(d) for d in docs_a]
        split_b = [split_sources(d) for d in docs_b]
        if [d for d, _ in split_a] != [d for d, _ in split_b]:
            print(f"{name}: DIFFERS outside the embedded component sources")
            structural += 1
            continue
        print(f"{name}: identical apart from embedded component sources:")
        for (_, src_a), (_, src_b) in zip(split_a, split_b, strict=True):
            for executor in sorted(src_a):
                if src_a[executor] != src_b.get(executor):
                    diff = difflib.unified_diff(
                        src_a[executor].splitlines(), src_b[executor].splitlines(), "before", "after", lineterm="", n=1
                    )
                    print(f"  {executor}:")
                    print("\n".join(f"    {line}" for line in diff))
    return 1 if structural else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
