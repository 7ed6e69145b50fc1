"""FP8 kernel benchmark: quantization bandwidth, block-scaled GEMMs and the FP8 linear, FP8 next to BF16.

Every row is measured in the same process on the same device: the BF16 baseline, the reference (torch)
quantizer, the fused kernels, cuBLAS block GEMMs, and ``FP8TrainLinear`` forward + backward against
``nn.Linear``.  Roofline figures come with each row: achieved GB/s against a device-to-device copy
measured in the same run (bytes read + written), and TFLOP/s.

    python -m fp8rl.bench.kernels --shapes 8192x14336x4096,8192x4096x4096 --json out.json
    fp8rl bench kernels ...   (the same)

Needs a CUDA GPU with FP8 tensor cores; the block GEMM and the fused linear need sm_90 (Hopper).
Times are the median of CUDA-event timings after warm-up; inputs are bf16 N(0, 1), weights N(0, 0.02).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from fp8rl.atomic import atomic_write_text
from fp8rl.bench.host_costs import host_costs, host_profile
from fp8rl.bench.kernels_report import format_tables
from fp8rl.bench.timing import back_to_back_ms, copy_bandwidth_gbs, gpu_time_ms, time_ms

# torch is imported inside the functions: the `fp8rl` command builds its parser from this module
# and must stay quick to start.

DEFAULT_SHAPES = "8192x14336x4096,8192x4096x4096,4096x4096x4096,256x1536x1536"


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"MxNxK,..."`` -> ``[(M, N, K), ...]``; a clear error naming the bad item."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: {item!r} is not MxNxK with positive integers (e.g. 8192x4096x4096)")
        m, n, k = (int(p) for p in parts)
        shapes.append((m, n, k))
    return shapes


def _quant_rows(m: int, k: int, copy_gbs: float) -> list[dict[str, Any]]:
    import torch

    from fp8rl.quant import QuantSpec, kernels, quantize_activation, quantize_weight
    from fp8rl.quant.formats import E4M3

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    n_el = m * k
    groups = math.ceil(k / 128)
    spec = QuantSpec()
    # (name, fn, minimal bytes: input read once + outputs written once)
    cases: list[tuple[str, Callable[[], object], int]] = [
        ("act 1x128 reference (torch)", lambda: quantize_activation(x, spec, backend="torch", check_finite=False), 2 * n_el + n_el + 4 * m * groups),
        ("act 1x128 fused", lambda: kernels.quantize_groups(x, E4M3, False, 128), 2 * n_el + n_el + 4 * m * groups),
        ("act 1x128 + transposed fused", lambda: kernels.quantize_groups(x, E4M3, False, 128, colwise=True),
         2 * n_el + 2 * n_el + 4 * (m * groups + k * math.ceil(m / 128))),
        ("weight 128x128 reference (torch)", lambda: quantize_weight(x, spec, backend="torch", check_finite=False), 3 * n_el),
        ("weight 128x128 fused", lambda: kernels.quantize_tiles(x, E4M3, False), 3 * n_el),
        ("weight 128x128 + transposed fused", lambda: kernels.quantize_tiles(x, E4M3, False, transpose=True), 4 * n_el),
        ("row fused", lambda: kernels.quantize_rows(x, E4M3, False), 3 * n_el + 4 * m),
        ("tensor fused (2 passes)", lambda: kernels.quantize_tensor(x, E4M3, False), 3 * n_el),
    ]  # fmt: skip
    rows = []
    for name, fn, nbytes in cases:
        eager = time_ms(fn)
        ms = gpu_time_ms(fn)
        gbs = nbytes / ms / 1e6
        rows.append({"shape": [m, k], "kernel": name, "ms": ms, "eager_ms": eager, "gb_per_s": gbs,
                     "fraction_of_copy": gbs / copy_gbs})  # fmt: skip
    return rows


ROWWISE_CANDIDATES = [(16, 2), (16, 4), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8)]
COLWISE_CANDIDATES = [
    (128, 4, "fused"), (128, 8, "fused"), (128, 16, "fused"),
    (16, 2, "split"), (32, 2, "split"), (32, 4, "split"), (64, 4, "split"), (64, 8, "split"), (128, 4, "split"),
    (128, 8, "split"),
]  # fmt: skip
TILES_CANDIDATES = [4, 8, 16]


def sweep_quant_configs(shapes: Sequence[tuple[int, int]], copy_gbs: float) -> dict[str, Any]:
    """Device time of each launch configuration of the fused quantizers at each ``[m, k]`` (bytes identical across
    them), and the fastest of each kind over all the shapes (summed time), in ``launch_config.parse_launch``'s form.

    The rowwise sweep runs first and its winner is in use for the rest: the split mode's rowwise launch is one."""
    import torch

    from fp8rl.quant import kernels, launch_config
    from fp8rl.quant.formats import E4M3

    before = launch_config.launch_now()
    xs = {(m, k): torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m, k in shapes}
    rows: list[dict[str, Any]] = []

    def measure(kind: str, label: Sequence[Any], bytes_per_value: int, **kw: Any) -> float:
        fn = kernels.quantize_tiles if kind.startswith("tiles") else kernels.quantize_groups
        total = 0.0
        for (m, k), x in xs.items():
            ms = gpu_time_ms(functools.partial(fn, x, E4M3, False, **kw))
            total += ms
            rows.append({"shape": [m, k], "kernel": kind, "config": list(label), "ms": ms,
                         "fraction_of_copy": bytes_per_value * m * k / ms / 1e6 / copy_gbs})  # fmt: skip
        return total

    def fastest(times: dict[Any, float]) -> Any:
        return min(times, key=lambda c: times[c])

    best: dict[str, Any] = {}
    try:
        row = fastest({(b, w): measure("groups", (b, w), 3, config=(b, w, "")) for b, w in ROWWISE_CANDIDATES})
        best["rowwise"] = list(row)
        launch_config.set_launch({"rowwise": (*row, "")})
        col = fastest({c: measure("groups+transposed", c, 4, colwise=True, config=c) for c in COLWISE_CANDIDATES})
        best["colwise"] = list(col)
        best["tiles_warps"] = fastest(
            {w: measure("tiles+transposed", (w,), 4, transpose=True, warps=w) for w in TILES_CANDIDATES}
        )
    finally:
        launch_config.set_launch(launch_config.launch_from(before))
    return {"rows": rows, "best": best, "default": before}


def _gemm_rows(m: int, n: int, k: int) -> dict[str, Any]:
    import torch

    from fp8rl.quant import QuantSpec, fp8_gemm, quantize_activation, quantize_weight

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    out: dict[str, Any] = {"mnk": [m, n, k]}
    out["bf16_ms"] = time_ms(lambda: x @ w.t())
    tq = quantize_activation(x, QuantSpec(granularity="tensor"))
    tw = quantize_weight(w, QuantSpec(granularity="tensor"))
    out["fp8_tensor_gemm_ms"] = time_ms(lambda: fp8_gemm(tq, tw))
    if torch.cuda.get_device_capability()[0] == 9 and k % 128 == 0 and n % 128 == 0:
        out |= _block_gemm_rows(x, w, out["bf16_ms"])
        out |= _row_gemm_rows(x, w)
    return out


def _block_gemm_rows(x: Any, w: Any, bf16_ms: float) -> dict[str, Any]:
    """The block recipe's GEMMs at ``x [M, K]`` and ``w [N, K]``: forward, wgrad- and dgrad-shaped, the fused
    activation quantizer against the reference one, and the error against emulation (Hopper)."""
    import torch

    from fp8rl.quant import QuantSpec, fp8_gemm, quantize_activation, quantize_weight
    from fp8rl.quant.block_linear import quantize_block_input, quantize_block_weight
    from fp8rl.quant.gemm import block_scaled_mm, outer_major

    (m, k), n = x.shape, w.shape[0]
    spec = QuantSpec()
    out: dict[str, Any] = {}
    bw = quantize_block_weight(w, spec, transpose=False)
    xq, xs, _, _ = quantize_block_input(x, spec, rowwise=True, colwise=False)
    assert xq is not None and xs is not None
    out["fp8_block_gemm_ms"] = time_ms(lambda: block_scaled_mm(xq, xs, bw.q, bw.scale_cublas, True))
    out["act_quant_fused_ms"] = time_ms(lambda: quantize_block_input(x, spec, rowwise=True, colwise=False))
    out["act_quant_reference_ms"] = time_ms(lambda: quantize_activation(x, spec, backend="torch", check_finite=False))
    # wgrad-shaped: both operands 1x128-grouped along the contraction (here K plays the token role)
    wq = quantize_activation(w, spec)
    out["fp8_block_1x128x1x128_gemm_ms"] = time_ms(
        lambda: block_scaled_mm(xq[:m], xs, wq.data, outer_major(wq.scale_inv), False)
    )
    # dgrad-shaped: dX[M, K] = dY[M, N] @ W, contraction over N (1x128 x 128x128)
    gq, gs, _, _ = quantize_block_input(torch.randn(m, n, device="cuda", dtype=torch.bfloat16), spec, True, False)
    bwt = quantize_block_weight(w, spec, transpose=True)
    wt, wt_scale = bwt.qt, bwt.scale_t_cublas
    assert gq is not None and gs is not None and wt is not None and wt_scale is not None
    out["fp8_block_dgrad_gemm_ms"] = time_ms(lambda: block_scaled_mm(gq, gs, wt, wt_scale, True))
    gb = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out["bf16_dgrad_ms"] = time_ms(lambda: gb @ w)
    fast = block_scaled_mm(xq, xs, bw.q, bw.scale_cublas, True)[:m].float()
    ref = fp8_gemm(quantize_activation(x, spec), quantize_weight(w, spec), torch.float32, backend="emulated")
    out["block_rel_diff_vs_emulation"] = ((fast - ref).norm() / ref.norm()).item()
    out["block_speedup_gemm_only"] = bf16_ms / out["fp8_block_gemm_ms"]
    out["block_speedup_incl_quant"] = bf16_ms / (out["fp8_block_gemm_ms"] + out["act_quant_fused_ms"])
    flop = 2 * m * n * k
    out["tflops_bf16"] = flop / bf16_ms / 1e9
    out["tflops_fp8_block"] = flop / out["fp8_block_gemm_ms"] / 1e9
    out["block_both_quant_ms"] = time_ms(lambda: quantize_block_input(x, spec, rowwise=True, colwise=True))
    return out


def _row_gemm_rows(x: Any, w: Any) -> dict[str, Any]:
    """The row recipe (``fp8rl.quant.row_linear``): row-scaled GEMM, the per-token copy, the transposed
    per-column one."""
    from fp8rl.quant import QuantSpec
    from fp8rl.quant.row_linear import quantize_row_input, quantize_row_weight, row_mm

    row = QuantSpec(granularity="row")
    rw = quantize_row_weight(w, row)
    rq, rs, _, _ = quantize_row_input(x, row)
    assert rq is not None and rs is not None
    m = x.shape[0]
    return {
        "fp8_row_gemm_ms": time_ms(lambda: row_mm(rq, rs, rw.q, rw.scale, m)),
        "row_act_quant_ms": time_ms(lambda: quantize_row_input(x, row)),  # one pass, the row copy
        "row_both_quant_ms": time_ms(lambda: quantize_row_input(x, row, colwise=True)),  # + transposed copy
        "row_col_quant_ms": time_ms(lambda: quantize_row_input(x, row, rowwise=False, colwise=True)),
    }


def _linear_row(m: int, n: int, k: int) -> dict[str, Any]:
    import torch

    from fp8rl.quant import QuantSpec
    from fp8rl.train.fp8_linear import FP8TrainLinear

    base = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    fp8 = FP8TrainLinear.from_linear(
        torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16), QuantSpec()
    )
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def step(mod: torch.nn.Linear, bump: bool = False) -> Callable[[], None]:
        def run() -> None:
            if bump:  # a new weight version: the fused path re-quantizes W (as after every optimizer step)
                with torch.no_grad():
                    mod.weight.mul_(1.0)
            # a new tensor object each call, as every training step has: the fused path shares an input's
            # quantization only between linears that read the very same tensor (q/k/v, gate/up)
            mod(x.view_as(x)).backward(g)
            x.grad = None
            mod.weight.grad = None

        return run

    out: dict[str, Any] = {"mnk": [m, n, k], "fused": fp8._fused_operands() is not None}
    out["bf16_ms"] = time_ms(step(base))
    out["fp8_ms"] = time_ms(step(fp8))
    out["fp8_weight_requantized_each_call_ms"] = time_ms(step(fp8, bump=True))
    out["speedup"] = out["bf16_ms"] / out["fp8_ms"]
    out["speedup_weight_requantized"] = out["bf16_ms"] / out["fp8_weight_requantized_each_call_ms"]
    out["bf16_back_to_back_ms"], out["bf16_host_ms"] = back_to_back_ms(step(base))
    out["fp8_back_to_back_ms"], out["fp8_host_ms"] = back_to_back_ms(step(fp8))
    out["speedup_back_to_back"] = out["bf16_back_to_back_ms"] / out["fp8_back_to_back_ms"]
    out["fp8_device_ms"] = gpu_time_ms(step(fp8), calls=5, reps=5)
    out["bf16_device_ms"] = gpu_time_ms(step(base), calls=5, reps=5)
    out["speedup_device"] = out["bf16_device_ms"] / out["fp8_device_ms"]
    out["tflops_bf16"] = 3 * 2 * m * n * k / out["bf16_ms"] / 1e9
    out["tflops_fp8"] = 3 * 2 * m * n * k / out["fp8_ms"] / 1e9
    return out


def run(shapes: Sequence[tuple[int, int, int]], sweep: bool = False) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("fp8rl bench kernels needs a CUDA GPU")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth_gbs()
    result: dict[str, Any] = {
        "device": props.name,
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "copy_gb_per_s": copy_gbs,
        "quant": [],
        "gemm": [],
        "linear": [],
    }
    seen: set[tuple[int, int]] = set()
    for m, n, k in shapes:
        for mk in ((m, k), (m, n)):
            if mk not in seen:
                seen.add(mk)
                result["quant"].extend(_quant_rows(*mk, copy_gbs))
        result["gemm"].append(_gemm_rows(m, n, k))
        result["linear"].append(_linear_row(m, n, k))
        torch.cuda.empty_cache()
    if sweep:
        result["sweep"] = sweep_quant_configs(sorted(seen), copy_gbs)
        result["host_profile_8192x4096x4096"] = host_profile(8192, 4096, 4096)
        result["host_costs_us"] = host_costs()
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma-separated MxNxK list (default {DEFAULT_SHAPES})")
    p.add_argument("--json", default=None, help="write the full results here (written to a temp file, then renamed)")
    p.add_argument(
        "--sweep", action="store_true", help="also time each kernel launch configuration and profile host time"
    )
    p.add_argument(
        "--launch-json",
        default=None,
        help="with --sweep: write the fastest launch configurations here, as FP8RL_QUANT_LAUNCH reads them",
    )


def main_with_args(args: argparse.Namespace) -> int:
    import torch

    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        print(f"fp8rl bench kernels: error: {e}", file=sys.stderr)
        return 2
    if args.launch_json and not args.sweep:
        print("fp8rl bench kernels: error: --launch-json needs --sweep", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("fp8rl bench kernels: error: needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    result = run(shapes, sweep=args.sweep)
    if args.json:  # the measurements first: a table that fails to print loses nothing
        atomic_write_text(args.json, json.dumps(result, indent=2))
    if args.launch_json:
        atomic_write_text(args.launch_json, json.dumps(result["sweep"]["best"]))
    print(format_tables(result))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fp8rl bench kernels", description=__doc__.splitlines()[0])
    add_arguments(p)
    return main_with_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
