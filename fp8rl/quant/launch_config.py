"""The FP8 quantization kernels' launch configurations, and a record of what each launch quantized.

The configurations come from a sweep on an H100 (``fp8rl bench kernels --sweep``; docs/benchmarks.md);
``FP8RL_QUANT_LAUNCH`` replaces them in every process that imports this module (Ray's trainer workers inherit the
driver's). ``fp8rl.quant.kernels`` reads them at each launch, so ``set_launch`` applies from the next call on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


# Launch configurations, chosen by a sweep on an H100 (fp8rl.bench.kernels --sweep; docs/benchmarks.md):
# rowwise only: (rows per program, warps, -); with the transposed copy: (columns per program, warps, mode).
# ``FP8RL_QUANT_LAUNCH`` (JSON, as ``fp8rl bench kernels --sweep --launch-json`` writes it) replaces them at import.
GROUPS_ROWWISE_CONFIG: tuple[int, int, str] = (32, 4, "")
GROUPS_COLWISE_CONFIG: tuple[int, int, str] = (64, 4, "split")
TILES_WARPS = 16
LAUNCH_ENV = "FP8RL_QUANT_LAUNCH"
_WARPS = (1, 2, 4, 8, 16, 32)


def parse_launch(text: str, source: str = LAUNCH_ENV) -> dict[str, object]:
    """The launch configurations in ``text``: JSON ``{"rowwise": [rows, warps], "colwise": [columns, warps, mode],
    "tiles_warps": warps}``, each key optional; ``ValueError`` naming ``source`` and the key on anything else."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not JSON ({e})") from None
    return launch_from(raw, source)


def launch_from(raw: object, source: str = LAUNCH_ENV) -> dict[str, object]:
    """``parse_launch`` of already-decoded JSON (``launch_now()``'s form included): what ``set_launch`` takes."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    unknown = set(raw) - {"rowwise", "colwise", "tiles_warps"}
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {sorted(unknown)} (rowwise, colwise, tiles_warps)")
    out: dict[str, object] = {}
    if "rowwise" in raw:
        v = raw["rowwise"]
        ok = isinstance(v, list) and len(v) == 2 and all(type(i) is int for i in v)
        if not ok or not (is_pow2(v[0]) and v[0] <= 128 and v[1] in _WARPS):
            raise ValueError(f"{source}: rowwise must be [rows per program (power of two <= 128), warps], got {v!r}")
        out["rowwise"] = (v[0], v[1], "")
    if "colwise" in raw:
        v = raw["colwise"]
        ok = isinstance(v, list) and len(v) == 3 and type(v[0]) is int and type(v[1]) is int
        if not ok or v[2] not in ("split", "fused") or not (is_pow2(v[0]) and 16 <= v[0] <= 128 and v[1] in _WARPS):
            raise ValueError(
                f"{source}: colwise must be [columns per program (power of two, 16..128; 'fused' reads 128), warps, "
                f"'split' or 'fused'], got {v!r}"
            )
        out["colwise"] = (v[0], v[1], v[2])
    if "tiles_warps" in raw:
        v = raw["tiles_warps"]
        if type(v) is not int or v not in _WARPS:
            raise ValueError(f"{source}: tiles_warps must be one of {list(_WARPS)}, got {v!r}")
        out["tiles_warps"] = v
    return out


def set_launch(launch: dict[str, object]) -> None:
    """Use these launch configurations from now on in this process (``parse_launch``'s keys)."""
    global GROUPS_ROWWISE_CONFIG, GROUPS_COLWISE_CONFIG, TILES_WARPS
    GROUPS_ROWWISE_CONFIG = launch.get("rowwise", GROUPS_ROWWISE_CONFIG)  # type: ignore[assignment]
    GROUPS_COLWISE_CONFIG = launch.get("colwise", GROUPS_COLWISE_CONFIG)  # type: ignore[assignment]
    TILES_WARPS = launch.get("tiles_warps", TILES_WARPS)  # type: ignore[assignment]


def launch_now() -> dict[str, object]:
    """The launch configurations in use, in ``parse_launch``'s form (JSON-ready)."""
    return {
        "rowwise": list(GROUPS_ROWWISE_CONFIG[:2]),
        "colwise": list(GROUPS_COLWISE_CONFIG),
        "tiles_warps": TILES_WARPS,
    }


if os.environ.get(LAUNCH_ENV):  # every process that quantizes reads it: Ray's trainer workers inherit the driver's
    set_launch(parse_launch(os.environ[LAUNCH_ENV]))


# the last part of a launch's label (``record_launches``): which copies it writes; (rowwise, transposed) -> name
COPIES = {(True, False): "rowwise", (False, True): "transposed", (True, True): "rowwise_transposed"}
TILE_COPIES = {False: "tiles", True: "tiles_transposed"}


class _LaunchLog:
    """What each kernel launch quantized, in launch order, while ``record_launches`` is active (else nothing)."""

    launches: list[tuple[str, str]] | None = None


@contextmanager
def record_launches() -> Iterator[list[tuple[str, str]]]:
    """Collect ``(kernel name, label)`` per quantization kernel launched in the block (``("_groups_kernel",
    "1x128/16384x4096/rowwise")``, ...), in launch order: a profiler's kernel events of the same stream pair with them
    one to one, each event's name holding its kernel's (``fp8rl.train.step_profile``)."""
    before, launches = _LaunchLog.launches, list[tuple[str, str]]()
    _LaunchLog.launches = launches
    try:
        yield launches
    finally:
        _LaunchLog.launches = before


def launch_kernel(
    kernel: Any,  # a Triton JIT function
    grid: tuple[int, ...],
    args: tuple[object, ...],
    num_warps: int,
    label: tuple[object, ...] = (),
    **constexprs: object,
) -> None:
    if _LaunchLog.launches is not None:  # the label's parts joined only while recording (no cost otherwise)
        name = kernel.fn.__name__
        _LaunchLog.launches.append((name, "".join(map(str, label)) or name.strip("_")))
    kernel[grid](*args, **constexprs, num_warps=num_warps)
