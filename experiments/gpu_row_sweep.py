"""The row recipe's quantization launches on a GPU: each tile configuration of ``fp8rl.quant.row_linear`` at the 8B
benchmark's widths, GB/s against a device-to-device copy, next to the block recipe's launches of the same input.

Usage (GPU machine, repository root): ``python3 experiments/gpu_row_sweep.py [--json FILE]``.  Bytes counted: the bf16
input read once and each FP8 copy written once (scales ignored), as ``fp8rl bench kernels`` counts them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8rl.bench.timing import copy_bandwidth_gbs, time_ms
from fp8rl.quant import QuantSpec
from fp8rl.quant import row_linear as rl
from fp8rl.quant.block_linear import quantize_block_input

AMAX_TILES = [(128, 128, 8), (64, 128, 4), (128, 64, 4), (256, 128, 8)]
CAST_TILES = [(128, 64, 4), (64, 64, 4), (128, 128, 8), (64, 128, 4), (32, 128, 4)]


def sweep_shape(m: int, k: int, copy: float) -> list[dict[str, object]]:
    """Every launch of one ``[m, k]`` bf16 input (``rl.AMAX_TILE`` / ``rl.CAST_TILE`` restored after)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    row, block = QuantSpec(granularity="row"), QuantSpec()
    rows: list[dict[str, object]] = []

    def rec(kind: str, config: object, ms: float, copies: int) -> None:
        gbs = (2 + copies) * m * k / ms / 1e6
        rows.append({"shape": [m, k], "kind": kind, "config": config, "ms": ms, "gb_per_s": gbs, "of_copy": gbs / copy})
        print(f"{m}x{k} {kind:<22} {config!s:<32} {ms:7.3f} ms {gbs:7.0f} GB/s {gbs / copy:4.0%}", flush=True)

    rec("block rowwise", "-", time_ms(lambda: quantize_block_input(x, block, True, False)), 1)
    rec("block both", "-", time_ms(lambda: quantize_block_input(x, block, True, True)), 2)
    rec("row one pass", "-", time_ms(lambda: rl.quantize_row_input(x, row)), 1)
    default = (rl.AMAX_TILE, rl.CAST_TILE)
    try:
        for amax in AMAX_TILES:
            for cast in CAST_TILES:
                rl.AMAX_TILE, rl.CAST_TILE = amax, cast
                rec("row both", [amax, cast], time_ms(lambda: rl.quantize_row_input(x, row, colwise=True)), 2)
    finally:
        rl.AMAX_TILE, rl.CAST_TILE = default
    rec("row transposed only", default, time_ms(lambda: rl.quantize_row_input(x, row, False, True)), 1)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="16384x4096,16384x14336")
    p.add_argument("--json", default="row_sweep.json")
    a = p.parse_args()
    copy = copy_bandwidth_gbs()
    rows = [r for shape in a.shapes.split(",") for r in sweep_shape(*(int(v) for v in shape.split("x")), copy)]
    out = {"device": torch.cuda.get_device_name(), "copy_gb_per_s": copy, "rows": rows}
    (Path(os.environ.get("OUT", ".")) / a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
