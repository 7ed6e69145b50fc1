"""Where the host time of the fused FP8 linear goes (issue 13: the 4096-wide linear is host-bound).

Runs ``FP8TrainLinear`` forward + backward at M x N x K back to back under cProfile and prints the functions
with the most own time and cumulative time per call; the device time per call is printed next to it.
Usage on the GPU machine: ``python3 experiments/gpu_host_profile.py [M N K]``.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8rl.quant import QuantSpec
from fp8rl.train.fp8_linear import FP8TrainLinear


def main() -> None:
    m, n, k = (int(v) for v in sys.argv[1:4]) if len(sys.argv) >= 4 else (8192, 4096, 4096)
    lin = FP8TrainLinear.from_linear(
        torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16), QuantSpec()
    )
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        lin(x.view_as(x)).backward(g)  # a new tensor each call: no input-quantization sharing across calls
        if len(sys.argv) > 4:  # as fp8rl.bench.kernels does between calls
            x.grad = None
            lin.weight.grad = None

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    calls = 50
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    host = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / calls
    print(f"{m}x{n}x{k}: host {host * 1e3:.3f} ms/call, wall {wall * 1e3:.3f} ms/call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
