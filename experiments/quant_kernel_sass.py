"""Static cost of the FP8 quantization kernels: compile them for Hopper (sm_90) here, without a GPU, and count.

    python experiments/quant_kernel_sass.py [--json out.json]

For each ``fp8rl.quant.kernels._groups_kernel`` launch the trainer makes (rowwise, the split mode's transposed
launch, and the one-read 128x128 variant), this compiles the kernel as Triton specializes it at run time for
``quantize_block_input`` (a contiguous input: its unit strides become constants, the others divisible by 16),
disassembles the cubin with the ``cuobjdump`` Triton ships, and prints SASS instructions per quantized value,
registers per thread and the per-value count of the instructions IEEE division brings (``FCHK``, ``MUFU``).

Why: a memory-bound kernel must issue fewer instructions per value than the SM can issue while the memory
system streams that value.  An H200 SM issues 4 x 32 thread-instructions a cycle; at 4.2 TB/s over 132 SMs
and ~1.98 GHz, and ~3 bytes moved per value, that leaves ~24 instructions per value -- above it the kernel is
bound by instruction issue, not bandwidth (docs/benchmarks.md).  The counts are static (straight-line code:
one tile per program, so static ~ dynamic, slightly over: they include a dozen padding NOPs and the IEEE
division's slow path, which normal scales never take); the GPU benchmarks measure the time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
import triton.language as tl

from fp8rl.quant import kernels, launch_config

# (name, rowwise, transposed, rows per program, columns per program, warps): the launches quantize_groups makes
LAUNCHES = (
    ("rowwise", True, False, launch_config.GROUPS_ROWWISE_CONFIG[0], 128, launch_config.GROUPS_ROWWISE_CONFIG[1]),
    (
        "transposed (split mode)",
        False,
        True,
        128,
        launch_config.GROUPS_COLWISE_CONFIG[0],
        launch_config.GROUPS_COLWISE_CONFIG[1],
    ),
    ("both copies, one read (fused mode)", True, True, 128, 128, 16),
)


def compile_groups(rowwise: bool, transposed: bool, br: int, bc: int, warps: int) -> bytes:
    consts = {"FMT_MAX": 448.0, "POW2": False, "OUT": tl.float8e4nv, "G": 128, "BR": br, "BC": bc,
              "ROWWISE": rowwise, "TRANSPOSE": transposed}  # fmt: skip
    return kernels.compile_ahead(kernels._groups_kernel, "fp8e4nv", consts, warps, specialize=True)


def cuobjdump(cubin: bytes, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the counts here")
    args = ap.parse_args()
    rows = []
    for name, rw, tr, br, bc, warps in LAUNCHES:
        cubin = compile_groups(rw, tr, br, bc, warps)
        ops = [
            re.sub(r"^@!?U?P\w+\s+", "", m.group(1).strip()).split()[0].split(".")[0]
            for m in re.finditer(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", cuobjdump(cubin, "-sass"), re.M)
        ]
        regs = re.search(r"REG:(\d+)", cuobjdump(cubin, "-res-usage"))
        per_thread = br * bc / (warps * 32)
        count = Counter(ops)
        row = {
            "launch": name, "tile": f"{br}x{bc}", "warps": warps, "sass_instructions": len(ops),
            "per_value": len(ops) / per_thread, "registers": int(regs.group(1)) if regs else None,
            "division_per_value": (count["FCHK"] + count["MUFU"]) / per_thread,
        }  # fmt: skip
        rows.append(row)
        print(f"{name:36s} tile {row['tile']:8s} {warps:2d} warps: {row['per_value']:5.1f} SASS instructions per "
              f"value, {row['registers']} registers, FCHK+MUFU {row['division_per_value']:.2f} per value")  # fmt: skip
    if args.json:
        doc = {"triton": triton.__version__, "target": "sm_90", "launches": rows}
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2))
        tmp.rename(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
