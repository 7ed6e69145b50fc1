"""Host (CPU) cost of the FP8 linear's hot path: what ``fp8rl bench kernels --sweep`` adds to the device timings.

Where a step is host-bound, the device waits on Python and launches: these measure the host microseconds per call
of each piece (quantizers, GEMMs, an empty autograd function, the whole linear) and where a forward + backward
spends them (torch.profiler by op, cProfile by Python function).  Needs a CUDA GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# torch is imported inside the functions: the `fp8rl` command builds its parser from fp8rl.bench.kernels.


def host_profile(m: int, n: int, k: int, top: int = 20) -> list[dict[str, Any]]:
    """Host (CPU) time by op of one FP8 linear forward + backward: where the launch overhead goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fp8rl.quant import QuantSpec
    from fp8rl.train.fp8_linear import FP8TrainLinear

    lin = FP8TrainLinear.from_linear(
        torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16), QuantSpec()
    )
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        lin(x.view_as(x)).backward(g)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            lin(x.view_as(x)).backward(g)  # a new tensor each call (see _linear_row)
    torch.cuda.synchronize()
    rows = [{"op": e.key, "self_cpu_us_per_call": e.self_cpu_time_total / 5, "count": e.count / 5}
            for e in prof.key_averages()]  # fmt: skip
    return sorted(rows, key=lambda r: -r["self_cpu_us_per_call"])[:top]


def host_costs() -> dict[str, Any]:
    """Host microseconds per call of the pieces of the FP8 linear's hot path (no device sync in between)."""
    import torch

    from fp8rl.quant import QuantSpec, kernels
    from fp8rl.quant.block_linear import quantize_block_input, quantize_block_weight
    from fp8rl.quant.formats import E4M3
    from fp8rl.quant.gemm import block_scaled_mm
    from fp8rl.train.fp8_linear import FP8TrainLinear

    x = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    spec = QuantSpec()
    out: dict[str, Any] = {}
    out["quantize_groups"] = _host_us(lambda: kernels.quantize_groups(x, E4M3, False, 128))
    out["quantize_block_input_colwise"] = _host_us(lambda: quantize_block_input(x, spec, rowwise=True, colwise=True))
    out["torch_empty_x4"] = _host_us(lambda: [torch.empty(1024, 4096, device="cuda") for _ in range(4)])
    xq, xs, _, _ = quantize_block_input(x, spec, rowwise=True, colwise=False)
    assert xq is not None and xs is not None
    xq_, xs_ = xq, xs
    bw = quantize_block_weight(torch.randn(4096, 4096, device="cuda").bfloat16(), spec, False)
    out["block_scaled_mm"] = _host_us(lambda: block_scaled_mm(xq_, xs_, bw.q, bw.scale_cublas, True))
    out["bf16_mm"] = _host_us(lambda: x @ x.t())
    a = torch.randn(8, device="cuda", requires_grad=True)
    nothing = _pass_through()
    out["empty_autograd_function"] = _host_us(lambda: nothing.apply(a))
    lin = FP8TrainLinear.from_linear(torch.nn.Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16), spec)
    xg = x.clone().requires_grad_(True)
    out["fp8_linear_fwd_bwd"] = _host_us(lambda: lin(xg.view_as(xg)).sum().backward(), calls=50)
    base = torch.nn.Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    out["bf16_linear_fwd_bwd"] = _host_us(lambda: base(xg).sum().backward(), calls=50)
    out["cprofile_fp8_linear_20_calls"] = _cprofile_text(lambda: lin(xg.view_as(xg)).sum().backward(), calls=20)
    return out


def _host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Host microseconds per call of ``fn`` over ``calls`` calls after 5 untimed ones, the device synchronised
    only around them."""
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def _pass_through() -> Any:
    """An autograd function that returns its input: the cost of the autograd machinery alone."""
    import torch

    class Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
            return a

    return Nothing


def _cprofile_text(fn: Callable[[], object], calls: int) -> str:
    """cProfile of ``calls`` calls of ``fn`` (backward on this thread, so cProfile sees it), by own time."""
    import cProfile
    import io
    import pstats

    import torch

    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    return text.getvalue()[-6000:]
