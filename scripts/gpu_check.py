"""GPU evidence for the foundation: CPU/CUDA bit-identity, tensor-core FP8 GEMM vs emulation, and timings.

Writes a JSON summary to $OUT/gpu_check.json (or ./gpu_check.json). Run through scripts/gpu_check.sh.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8rl.quant import QuantSpec, fp8_gemm, fp8_gemm_backend, quantize, quantize_activation, quantize_weight


def bit_identity() -> dict[str, object]:
    cases, mismatches, elements = 0, [], 0
    gen = torch.Generator().manual_seed(0)
    for shape in [(8192, 8192), (3000, 1000), (129, 257), (1, 1)]:
        x = (torch.randn(shape, generator=gen) * torch.logspace(-5, 4, shape[1])).to(torch.bfloat16)
        for g in ["tensor", "row", "block"]:
            for fmt in ["e4m3", "e5m2"]:
                for pow2 in [False, True]:
                    for block in [(128, 128), (1, 128)]:
                        c = quantize(x, g, fmt, block, pow2)
                        d = quantize(x.cuda(), g, fmt, block, pow2)
                        cases += 1
                        elements += x.numel()
                        same = torch.equal(d.data.cpu().view(torch.uint8), c.data.view(torch.uint8)) and torch.equal(
                            d.scale_inv.cpu(), c.scale_inv
                        )
                        if not same:
                            mismatches.append(f"{shape} {g} {fmt} pow2={pow2} block={block}")
    return {"cases": cases, "elements_compared": elements, "mismatches": mismatches}


def bench(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def gemms() -> list[dict[str, object]]:
    rows = []
    for m, n, k in [(4096, 4096, 4096), (8192, 14336, 4096), (256, 1536, 1536)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        bf16_ms = bench(lambda x=x, w=w: x @ w.t())
        exact = (x.double() @ w.double().t()).float()
        for g in ["tensor", "row", "block"]:
            spec = QuantSpec(granularity=g)  # type: ignore[arg-type]
            xq, wq = quantize_activation(x, spec), quantize_weight(w, spec)
            backend = fp8_gemm_backend(xq, wq)
            fast = fp8_gemm(xq, wq, out_dtype=torch.float32)
            emu = fp8_gemm(xq, wq, out_dtype=torch.float32, backend="emulated")
            gemm_ms = bench(lambda xq=xq, wq=wq: fp8_gemm(xq, wq))
            quant_ms = bench(lambda x=x, spec=spec: quantize_activation(x, spec))
            rows.append(
                {
                    "mnk": [m, n, k],
                    "granularity": g,
                    "backend": backend,
                    "rel_diff_vs_emulation": ((fast - emu).norm() / emu.norm()).item(),
                    "rel_err_vs_fp64": ((fast - exact).norm() / exact.norm()).item(),
                    "bf16_gemm_ms": bf16_ms,
                    "fp8_gemm_ms": gemm_ms,
                    "act_quant_ms": quant_ms,
                    "tflops_bf16": 2 * m * n * k / bf16_ms / 1e9,
                    "tflops_fp8_gemm_only": 2 * m * n * k / gemm_ms / 1e9,
                }
            )
    return rows


def main() -> None:
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    result = {
        "device": props.name,
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "bit_identity": bit_identity(),
        "gemm": gemms(),
    }
    result["seconds"] = time.time() - t0
    out = Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
