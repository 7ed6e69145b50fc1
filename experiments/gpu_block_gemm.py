"""Block-scaled FP8 GEMMs on sm_90 side by side (issue 13, item 2): which one should the block recipe use?

Paths, all fed the same FP8 bytes and scales (the project's fused quantizers, ``fp8rl.quant.block_linear``):

    bf16           torch.matmul on the unquantized bf16 operands (the baseline)
    cublas_block   the project's path: ``fp8rl.quant.gemm.block_scaled_mm`` (torch 2.11 ``F.scaled_mm``, cuBLASLt,
                   1x128 activation groups x 128x128 weight tiles, or 1x128 x 1x128 for the wgrad)
    cutlass_block  vLLM's CUTLASS kernel, ``vllm._custom_ops.cutlass_scaled_mm`` (1x128 x 128x128 only)
    triton_block   vLLM's Triton block GEMM, ``fp8_utils.w8a8_triton_block_scaled_mm`` (its tuned config where vLLM
                   ships one for this N, K on this GPU, else its default)

for the three GEMMs of a linear ``Y = X @ W.T`` (X ``[M, K]``, W ``[N, K]``) as ``FP8TrainLinear`` issues them:

    fwd    Y  = X @ W.T     [M, N], contraction K: X 1x128 along K, W 128x128 tiles
    dgrad  dX = dY @ W      [M, K], contraction N: dY 1x128 along N, W.T 128x128 tiles (the transposed copy)
    wgrad  dW = dY.T @ X    [N, K], contraction M: dY.T and X.T both 1x128 along M (the recipe's colwise copies)
    wgrad_tiles            the wgrad with X.T in 128x128 tiles instead (NOT the project's recipe; only to see what a
                           kernel that needs 128x128 on its second operand would cost there)

Correctness: every FP8 output against the FP32 emulation (the dequantized operands multiplied in float32, TF32 off),
relative Frobenius error, and CUTLASS / Triton against cuBLAS. The CUTLASS check writes into a NaN-poisoned output
(``torch.ops._C.cutlass_scaled_mm``, the op under vLLM's wrapper) and calls it twice to see whether it is bitwise
repeatable (its Stream-K schedule, taken when K > 3N, reduces nondeterministically).
Timing: ``eager`` = CUDA events around one call, warm-up, median of 2 rounds x ``--reps`` calls (round 2 runs the
paths in reverse order; the two round medians are kept as the spread); ``graph`` = ``--graph-calls`` calls captured in
one CUDA graph and replayed (device time without host launch cost), median of ``--graph-reps`` replays per round.
Speedups are against BF16 of the same GEMM (same orientation). Probes after the main table: CUTLASS with M not a
multiple of 16, a 1x128 x 1x128 (wgrad) call, and a K whose K/128 is not a multiple of 4 with the weight scales in
cuBLAS's padded layout vs contiguous.

Writes ``$OUT/block_gemm_cutlass_h100.json`` (``--json``) and prints a table. Without CUDA, vLLM or sm_90 it records
what is missing and skips those paths (exit 0). ``--self-check`` tests the dequantization helpers against
``fp8rl.quant.dequantize`` on the CPU. On the GPU machine, from the repository root, after vLLM's setup:
    PYTHONPATH=/tmp/site:. python3 experiments/gpu_block_gemm.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(8192, 14336, 4096), (8192, 4096, 4096), (4096, 4096, 4096), (8192, 4096, 14336), (4096, 14336, 4096),
          (256, 1536, 1536)]  # fmt: skip
PATHS = ("bf16", "cublas_block", "cutlass_block", "triton_block")


def say(*a: object) -> None:
    print(*a, flush=True)


# ---------------------------------------------------------------- dequantization (the FP32 emulation's operands)


def deq_groups(q: torch.Tensor, s: torch.Tensor, group: int = 128) -> torch.Tensor:
    """``q [R, C]`` (FP8) with 1 x ``group`` scales ``s [R, ceil(C/group)]`` (any strides) -> float32."""
    full = s.float().repeat_interleave(group, dim=1)[:, : q.shape[1]]
    return q.float() * full


def deq_tiles(q: torch.Tensor, s: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """``q [R, C]`` (FP8) with ``tile`` x ``tile`` scales ``s [ceil(R/tile), ceil(C/tile)]`` -> float32."""
    full = s.float().repeat_interleave(tile, dim=0).repeat_interleave(tile, dim=1)[: q.shape[0], : q.shape[1]]
    return q.float() * full


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_F / ||ref||_F`` in float32 (inf where ``out`` holds a NaN or Inf)."""
    o = out.float()
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    return float((o - ref.float()).norm() / ref.float().norm())


def self_check() -> dict[str, Any]:
    """The helpers above against ``fp8rl.quant.dequantize`` of the reference quantizers (CPU)."""
    from fp8rl.quant import QuantSpec, dequantize, quantize_activation, quantize_weight

    torch.manual_seed(0)
    spec = QuantSpec()
    x, w = torch.randn(64, 384), torch.randn(256, 384) * 0.02
    xa, wq = quantize_activation(x, spec), quantize_weight(w, spec)
    # the GEMM's scales come outer-major (stride (1, rows)): check that layout too
    xs_outer = xa.scale_inv.t().contiguous().t()
    errs = {
        "groups": float((deq_groups(xa.data, xs_outer) - dequantize(xa)).abs().max()),
        "tiles": float((deq_tiles(wq.data, wq.scale_inv) - dequantize(wq)).abs().max()),
    }
    ok = all(v == 0.0 for v in errs.values())
    say(f"self-check: max |diff| vs fp8rl.quant.dequantize {errs} -> {'OK' if ok else 'FAIL'}")
    return {"max_abs_diff": errs, "ok": ok}


# ---------------------------------------------------------------- timing


def eager_samples(fn: Callable[[], object], reps: int, warmup: int = 5) -> list[float]:
    """Milliseconds of single calls between CUDA events (host launch cost included), after ``warmup`` calls."""
    from fp8rl.bench.timing import event_samples_ms

    return event_samples_ms(fn, reps, warmup)


def make_graph(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    from fp8rl.bench.timing import capture_graph

    return capture_graph(fn, calls, warmup=3)


def graph_samples(graph: torch.cuda.CUDAGraph, calls: int, reps: int) -> list[float]:
    """Milliseconds per call of ``calls`` captured calls, one sample per replay."""
    return [t / calls for t in eager_samples(graph.replay, reps, warmup=2)]


# ---------------------------------------------------------------- the paths


class Env:
    """What this process can run: the project's cuBLAS path, vLLM's CUTLASS and Triton ops."""

    def __init__(self, want_triton: bool) -> None:
        self.info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
        self.cuda = torch.cuda.is_available()
        self.vllm_ops: Any = None
        self.cutlass_raw: Any = None
        self.triton_mm: Any = None
        if not self.cuda:
            self.info["skipped"] = "no CUDA device"
            return
        props = torch.cuda.get_device_properties(0)
        cap = torch.cuda.get_device_capability(0)
        self.info.update(device=props.name, capability=list(cap), sms=props.multi_processor_count,
                         cuda=torch.version.cuda, cublaslt="torch.nn.functional.scaled_mm")  # fmt: skip
        try:
            import triton

            self.info["triton"] = triton.__version__
        except ImportError:
            self.info["triton"] = None
        self.sm90 = cap[0] == 9
        if not self.sm90:
            self.info["cublas_block"] = "skipped: cuBLAS 1x128 / 128x128 block scaling is sm_90 only"
        try:
            import vllm
            from vllm import _custom_ops as ops

            self.info["vllm"] = vllm.__version__
            self.info["cutlass_scaled_mm_supports_block_fp8"] = bool(
                ops.cutlass_scaled_mm_supports_block_fp8(cap[0] * 10 + cap[1])
            )
            self.vllm_ops = ops
            self.cutlass_raw = getattr(torch.ops._C, "cutlass_scaled_mm", None)
        except Exception as e:  # ImportError, or a missing/broken extension
            self.info["vllm"] = f"unavailable: {type(e).__name__}: {e}"
        if self.vllm_ops is not None and want_triton:
            try:
                from vllm.model_executor.layers.quantization.utils.fp8_utils import (
                    get_w8a8_block_fp8_configs,
                    w8a8_triton_block_scaled_mm,
                )

                self.triton_mm = w8a8_triton_block_scaled_mm
                self.triton_configs = get_w8a8_block_fp8_configs
            except Exception as e:
                self.info["triton_block"] = f"unavailable: {type(e).__name__}: {e}"

    def cutlass(self, a: torch.Tensor, a_s: torch.Tensor, b_nk: torch.Tensor, b_s_kn: torch.Tensor) -> torch.Tensor:
        """``a [M, K] @ b_nk.T`` via vLLM's wrapper: ``b`` passed as ``b_nk.t()`` ([K, N] column-major), ``a_s``
        ``[M, K/128]`` M-major (stride (1, M)), ``b_s_kn`` ``[K/128, N/128]`` K-major (stride (1, K/128))."""
        return self.vllm_ops.cutlass_scaled_mm(a, b_nk.t(), scale_a=a_s, scale_b=b_s_kn, out_dtype=torch.bfloat16)

    def cutlass_poisoned(
        self, a: torch.Tensor, a_s: torch.Tensor, b_nk: torch.Tensor, b_s_kn: torch.Tensor
    ) -> torch.Tensor:
        """The same op writing into a NaN-filled output (every element must be written)."""
        if self.cutlass_raw is None:
            return self.cutlass(a, a_s, b_nk, b_s_kn)
        out = torch.full((a.shape[0], b_nk.shape[0]), float("nan"), dtype=torch.bfloat16, device=a.device)
        self.cutlass_raw(out, a, b_nk.t(), a_s, b_s_kn, None)
        return out


def k_major(scale_nk: torch.Tensor) -> torch.Tensor:
    """Tile scales given as a row-major-ish view ``[N/128, K/128]`` -> ``[K/128, N/128]`` with stride (1, K/128)
    (a copy unless already so): CUTLASS reads only the pointer, with an implied leading dimension of K/128."""
    kb = scale_nk.shape[1]
    if scale_nk.stride() == (kb, 1):
        return scale_nk.t()
    return scale_nk.contiguous().t()


# ---------------------------------------------------------------- one shape


def gemm_cases(m: int, n: int, k: int, env: Env) -> dict[str, dict[str, Any]]:
    """The operands and path callables of fwd / dgrad / wgrad / wgrad_tiles at ``M x N x K``."""
    from fp8rl.quant import QuantSpec
    from fp8rl.quant.block_linear import quantize_block_input, quantize_block_weight
    from fp8rl.quant.gemm import block_scaled_mm

    spec = QuantSpec()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 0.01
    xq, xs, xqt, xst = quantize_block_input(x, spec, rowwise=True, colwise=True)  # rows padded to 128 (none here)
    gq, gs, gqt, gst = quantize_block_input(g, spec, rowwise=True, colwise=True)
    bw = quantize_block_weight(w, spec, transpose=True)
    assert all(t is not None for t in (xq, xs, xqt, xst, gq, gs, gqt, gst, bw.qt, bw.scale_t))
    mp = xq.shape[0]
    cases: dict[str, dict[str, Any]] = {}

    def add(name: str, shape: tuple[int, int, int], bf16: Callable[[], torch.Tensor], ref: Callable[[], torch.Tensor],
            a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s_cublas: torch.Tensor, b_tiles: bool,
            b_s_view: torch.Tensor, rows: int, note: str) -> None:  # fmt: skip
        paths: dict[str, Callable[[], torch.Tensor] | str] = {"bf16": bf16}
        if env.sm90:
            paths["cublas_block"] = lambda: block_scaled_mm(a, a_s, b, b_s_cublas, b_tiles)
        if env.vllm_ops is not None:
            if b_tiles:
                b_s_kn = k_major(b_s_view)
                paths["cutlass_block"] = lambda: env.cutlass(a, a_s, b, b_s_kn)
            else:
                paths["cutlass_block"] = "not run: vLLM's op takes 128x128 scales on its second operand only"
        if env.triton_mm is not None:
            if b_tiles:
                paths["triton_block"] = lambda: env.triton_mm(a, b, a_s, b_s_view, [128, 128], torch.bfloat16)
            else:
                paths["triton_block"] = "not run: vLLM's Triton block GEMM takes 128x128 weight scales only"
        cases[name] = {"mnk_gemm": list(shape), "paths": paths, "ref": ref, "rows": rows, "note": note,
                       "poisoned": (a, a_s, b, b_s_view) if b_tiles else None}  # fmt: skip

    add("fwd", (m, n, k), lambda: x @ w.t(),
        lambda: deq_groups(xq[:m], xs[:m]) @ deq_tiles(bw.q, bw.scale).t(),
        xq, xs, bw.q, bw.scale_cublas, True, bw.scale, m, "Y = X @ W.T")  # fmt: skip
    add("dgrad", (m, k, n), lambda: g @ w,
        lambda: deq_groups(gq[:m], gs[:m]) @ deq_tiles(bw.qt, bw.scale_t).t(),
        gq, gs, bw.qt, bw.scale_t_cublas, True, bw.scale_t, m, "dX = dY @ W (W.T in 128x128 tiles)")  # fmt: skip
    add("wgrad", (n, k, mp), lambda: g.t() @ x,
        lambda: deq_groups(gqt, gst) @ deq_groups(xqt, xst).t(),
        gqt, gst, xqt, xst, False, xst, n, "dW = dY.T @ X, both 1x128 along M (the recipe)")  # fmt: skip
    if mp == m:  # the tiles of X.T cover the same (unpadded) token axis as dY.T's colwise copy
        xt_tiles = quantize_block_weight(x.t().contiguous(), spec, transpose=False)  # [K, M] in 128x128 tiles
        add("wgrad_tiles", (n, k, mp), lambda: g.t() @ x,
            lambda: deq_groups(gqt, gst) @ deq_tiles(xt_tiles.q, xt_tiles.scale).t(),
            gqt, gst, xt_tiles.q, xt_tiles.scale_cublas, True, xt_tiles.scale, n,
            "dW with X.T in 128x128 tiles: NOT the recipe")  # fmt: skip
    return cases


def run_case(case: dict[str, Any], env: Env, a: argparse.Namespace) -> dict[str, Any]:
    mg, ng, kg = case["mnk_gemm"]
    flop = 2 * mg * ng * kg
    rows = case["rows"]
    res: dict[str, Any] = {"mnk_gemm": case["mnk_gemm"], "note": case["note"], "paths": {}}
    torch.set_float32_matmul_precision("highest")  # the emulation in true float32 (no TF32)
    ref = case["ref"]()
    outs: dict[str, torch.Tensor] = {}
    runnable: dict[str, Callable[[], torch.Tensor]] = {}
    for name, fn in case["paths"].items():
        r: dict[str, Any] = {}
        res["paths"][name] = r
        if isinstance(fn, str):
            r["error"] = fn
            continue
        try:
            out = fn()[:rows]
            torch.cuda.synchronize()
            outs[name] = out
            if name != "bf16":
                r["rel_err_vs_fp32_emulation"] = rel_err(out, ref)
            runnable[name] = fn
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    del ref
    for name in ("cutlass_block", "triton_block"):
        if name in outs and "cublas_block" in outs:
            res["paths"][name]["rel_diff_vs_cublas"] = rel_err(outs[name], outs["cublas_block"])
    if "cutlass_block" in outs and case["poisoned"] is not None:
        pa, pa_s, pb, pb_s = case["poisoned"]
        p1 = env.cutlass_poisoned(pa, pa_s, pb, k_major(pb_s))
        p2 = env.cutlass_poisoned(pa, pa_s, pb, k_major(pb_s))
        torch.cuda.synchronize()
        r = res["paths"]["cutlass_block"]
        r["poisoned_all_written"] = bool(torch.isfinite(p1[:rows]).all())
        r["repeat_bitwise_equal"] = bool(torch.equal(p1, p2))
        r["repeat_max_abs_diff"] = float((p1.float() - p2.float()).abs().max())
        del p1, p2
    outs.clear()
    # timing: round 1 in PATHS order, round 2 reversed
    samples: dict[str, dict[str, list[float]]] = {n: {"eager": [], "graph": []} for n in runnable}
    graphs: dict[str, torch.cuda.CUDAGraph | None] = {}
    for name, fn in runnable.items():
        try:
            graphs[name] = make_graph(fn, a.graph_calls)
        except Exception as e:
            graphs[name] = None
            res["paths"][name]["graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            torch.cuda.synchronize()
    order = [n for n in PATHS if n in runnable]
    for rnd in (order, order[::-1]):
        for name in rnd:
            e = eager_samples(runnable[name], a.reps)
            samples[name]["eager"].append(statistics.median(e))
            samples[name].setdefault("eager_all", []).extend(e)
            gr = graphs[name]
            if gr is not None:
                per_call = graph_samples(gr, a.graph_calls, a.graph_reps)
                samples[name]["graph"].append(statistics.median(per_call))
                samples[name].setdefault("graph_all", []).extend(per_call)
    graphs.clear()
    for name, s in samples.items():
        r = res["paths"][name]
        r["eager_ms"] = statistics.median(s["eager_all"])
        r["eager_ms_round_medians"] = s["eager"]
        if s["graph"]:
            r["graph_ms"] = statistics.median(s["graph_all"])
            r["graph_ms_round_medians"] = s["graph"]
        r["tflops_eager"] = flop / r["eager_ms"] / 1e9
        if "graph_ms" in r:
            r["tflops_graph"] = flop / r["graph_ms"] / 1e9
    base = res["paths"].get("bf16", {})
    for r in res["paths"].values():
        for kind in ("eager", "graph"):
            if f"{kind}_ms" in r and f"{kind}_ms" in base:
                r[f"speedup_vs_bf16_{kind}"] = base[f"{kind}_ms"] / r[f"{kind}_ms"]
    return res


# ---------------------------------------------------------------- probes (after the main results: a failure here
# cannot spoil them)


def probes(env: Env) -> dict[str, Any]:
    from fp8rl.quant import QuantSpec
    from fp8rl.quant.block_linear import quantize_block_input, quantize_block_weight
    from fp8rl.quant.gemm import block_scaled_mm

    spec = QuantSpec()
    out: dict[str, Any] = {}

    def attempt(name: str, fn: Callable[[], Any]) -> None:
        try:
            out[name] = fn()
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        torch.cuda.synchronize()

    def fwd_err(m: int, n: int, k: int, padded_scales: bool) -> dict[str, Any]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xq, xs, _, _ = quantize_block_input(x, spec, rowwise=True, colwise=False)  # rows padded to 16
        bw = quantize_block_weight(w, spec, transpose=False)
        ref = deq_groups(xq[:m], xs[:m]) @ deq_tiles(bw.q, bw.scale).t()
        r: dict[str, Any] = {"m_padded_by_project": xq.shape[0]}
        # unpadded M straight into CUTLASS (the scales then have stride (1, M))
        xs_m = xs[:m].contiguous().t().contiguous().t() if xq.shape[0] != m else xs
        b_s = bw.scale_cublas[: bw.scale.shape[1]] if padded_scales else k_major(bw.scale)
        r["scale_b_strides"] = list(b_s.stride())
        c = env.cutlass_poisoned(xq[:m].contiguous(), xs_m, bw.q, b_s)
        r["cutlass_rel_err"] = rel_err(c, ref)
        r["cublas_rel_err"] = rel_err(block_scaled_mm(xq, xs, bw.q, bw.scale_cublas, True)[:m], ref)
        return r

    if env.vllm_ops is None:
        return {"skipped": "vLLM unavailable"}

    def wgrad_1x128() -> dict[str, Any]:
        m, n, k = 256, 1536, 1536
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        _, _, gqt, gst = quantize_block_input(g, spec, rowwise=False, colwise=True)
        _, _, xqt, xst = quantize_block_input(x, spec, rowwise=False, colwise=True)
        assert gqt is not None and xqt is not None and xst is not None
        # b = X.T's colwise copy [K, Mp] passed [Mp, K] column-major, its 1x128 scales as given
        env.vllm_ops.cutlass_scaled_mm(gqt, xqt.t(), scale_a=gst, scale_b=xst.t(), out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        return {"error": None, "note": "accepted (unexpected): check its result before use"}

    # shape checks on the host first; the probes that could fault on the device last
    attempt("cutlass_wgrad_1x128_x_1x128", wgrad_1x128)
    # K/128 = 13: cuBLAS's layout pads the K-block count to 16; CUTLASS assumes a leading dimension of 13
    attempt("cutlass_k1664_contiguous_scales", lambda: fwd_err(256, 1536, 1664, False))
    attempt("cutlass_k1664_cublas_padded_scales", lambda: fwd_err(256, 1536, 1664, True))
    attempt("cutlass_m1000_n4096_k4096", lambda: fwd_err(1000, 4096, 4096, False))
    attempt("cutlass_m100_n4096_k4096", lambda: fwd_err(100, 4096, 4096, False))
    return out


# ---------------------------------------------------------------- main


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| M x N x K | GEMM | path | eager ms | graph ms | TFLOP/s (graph) | vs BF16 eager | vs BF16 graph "
             "| rel err vs FP32 emul. | vs cuBLAS |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for row in results:
        shape = "x".join(map(str, row["mnk"]))
        for gemm, res in row["gemms"].items():
            for name, r in res["paths"].items():
                if "error" in r:
                    lines.append(f"| {shape} | {gemm} | {name} | {r['error'][:90]} | | | | | | |")
                    continue
                lines.append(
                    f"| {shape} | {gemm} | {name} | {f(r.get('eager_ms'), '.3f')} | {f(r.get('graph_ms'), '.3f')} "
                    f"| {f(r.get('tflops_graph'), '.0f')} | {f(r.get('speedup_vs_bf16_eager'), '.2f')}x "
                    f"| {f(r.get('speedup_vs_bf16_graph'), '.2f')}x | {f(r.get('rel_err_vs_fp32_emulation'), '.2e')} "
                    f"| {f(r.get('rel_diff_vs_cublas'), '.2e')} |"
                )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES), help="MxNxK,...")
    p.add_argument("--gemms", default="fwd,dgrad,wgrad,wgrad_tiles")
    p.add_argument("--reps", type=int, default=30, help="eager calls per round (2 rounds)")
    p.add_argument("--graph-calls", type=int, default=10)
    p.add_argument("--graph-reps", type=int, default=20, help="graph replays per round")
    p.add_argument("--no-triton", action="store_true")
    p.add_argument("--json", default="block_gemm_cutlass_h100.json")
    p.add_argument("--self-check", action="store_true", help="CPU test of the dequantization helpers, then exit")
    a = p.parse_args()
    if a.self_check:
        return 0 if self_check()["ok"] else 1
    out_dir = Path(os.environ.get("OUT", "."))
    out_path = out_dir / a.json
    env = Env(want_triton=not a.no_triton)
    doc: dict[str, Any] = {"env": env.info, "args": vars(a), "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                           "results": []}  # fmt: skip
    say(json.dumps(env.info))

    def save() -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(doc, indent=1) + "\n")

    if not env.cuda:
        say("no CUDA device: nothing measured")
        save()
        return 0
    wanted = a.gemms.split(",")
    for spec in a.shapes.split(","):
        m, n, k = map(int, spec.split("x"))
        t0 = time.time()
        row: dict[str, Any] = {"mnk": [m, n, k], "gemms": {}}
        doc["results"].append(row)
        try:
            torch.manual_seed(m * 7 + n * 3 + k)
            cases = gemm_cases(m, n, k, env)
            if env.triton_mm is not None:
                row["triton_tuned_config_for_fwd"] = bool(env.triton_configs(n, k, 128, 128))
            for gemm in wanted:
                if gemm in cases:
                    row["gemms"][gemm] = run_case(cases[gemm], env, a)
                    r = row["gemms"][gemm]["paths"]
                    say(f"{spec} {gemm}: " + ", ".join(
                        f"{nm} {v['graph_ms']:.3f} ms" if "graph_ms" in v else f"{nm} {v.get('error', '?')[:60]}"
                        for nm, v in r.items()))  # fmt: skip
            del cases
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        row["seconds"] = round(time.time() - t0, 1)
        torch.cuda.empty_cache()
        save()
    doc["probes"] = probes(env)
    save()
    say(json.dumps(doc["probes"], indent=1))
    say(table(doc["results"]))
    say(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
