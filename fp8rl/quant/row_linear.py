"""The fast path of an FP8 linear under the row recipe on Hopper: fused row quantization + row-scaled GEMMs.

The row recipe (``quant.granularity: row``; torchao's "rowwise" float8 training, vLLM's per-channel W8A8) gives
every operand of every GEMM one scale per row of the operand as the GEMM reads it, the row spanning the whole
reduction dimension, so the scales factor out of the dot products (``out[m, n] = sa[m] * sb[n] * sum_k ...``):

    forward  Y  = X  @ W.T     X: a scale per token                  W:   a scale per output channel
    dgrad    dX = dY @ W       dY: a scale per token                 W.T: a scale per input channel
    wgrad    dW = dY.T @ X     dY.T: a scale per output channel      X.T: a scale per input channel
                               (each over all the micro-batch's tokens)

These are the reference's quantizations (``quantize_activation`` of ``X``, ``dY``, ``dY.T``, ``X.T`` and
``quantize_weight`` of ``W`` and ``W.T`` with ``granularity='row'``), byte for byte: only the GEMMs' summation order
differs from the reference linear.  The rollout engine's per-channel weights (``rollout.fp8_scaling: channel``) are
the forward's ``W`` copy.  The GEMMs are ``torch._scaled_mm`` with row-wise scales (cuBLAS on sm_90): at Llama-8B
shapes on an H100 as fast as the block recipe's forward kind or 13-19% faster, and 19-30% faster than its wgrad kind
(``fp8rl bench kernels``; docs/benchmarks.md).

The copies along the tokens (``dY.T``, ``X.T``) cannot be made in one pass: a column's scale needs the whole
column's amax first.  ``quantize_rows_cols`` makes both copies of an input from two reads of it (the row and column
amaxes, then one cast pass writing both), the same traffic as the block recipe's two launches; the row copy alone
(the forward under activation checkpointing, the logprob pass) is one read (``quantize_rows_one_pass``).  As in the
block path, a checkpointed layer's first forward makes only the row copy and the recompute both, keeping the
transposed FP8 copy for the backward instead of X.  Token counts are padded with zero rows to a multiple of 16
(cuBLAS), which changes no scale of a real row or column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8rl.quant import kernels
from fp8rl.quant.formats import FP8Format, get_format
from fp8rl.quant.kernels import triton
from fp8rl.quant.launch_config import COPIES, launch_kernel
from fp8rl.quant.quantize import QuantSpec

if triton is not None:
    import triton.language as tl

    from fp8rl.quant.kernels import _abs_nan_as_inf, _cast, _fp8_tl_dtype, _inverse, _scale_of

    @triton.jit
    def _row_one_pass_kernel(
        x_ptr, q_ptr, s_ptr, R, C, sx_r, sx_c, sq_r,
        FMT_MAX: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        # one program per output row, the whole row (BC >= C) in registers: one read, one write; rows >= R are zeros
        row = tl.program_id(0)
        cols = tl.arange(0, BC)
        ok = cols < C
        x = tl.load(x_ptr + row.to(tl.int64) * sx_r + cols.to(tl.int64) * sx_c, mask=ok & (row < R), other=0.0)
        x = x.to(tl.float32)
        s = _scale_of(tl.max(_abs_nan_as_inf(x), axis=0), FMT_MAX, POW2)
        tl.store(q_ptr + row.to(tl.int64) * sq_r + cols, _cast(x, _inverse(s), FMT_MAX, OUT), mask=ok)
        tl.store(s_ptr + row, s)

    @triton.jit
    def _amax_rows_cols_kernel(
        x_ptr, ramax_ptr, camax_ptr, R, C, sx_r, sx_c,
        BR: tl.constexpr, BC: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
    ):  # fmt: skip
        # each program folds its BR x BC tile's row and/or column maxima into ramax [R] / camax [C] (zeros first;
        # |x| >= 0, so a float atomic max is exact and order-free)
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        ok = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx_r + cols[None, :].to(tl.int64) * sx_c, mask=ok, other=0.0)
        a = _abs_nan_as_inf(x.to(tl.float32))
        if ROWS:
            tl.atomic_max(ramax_ptr + rows, tl.max(a, axis=1), mask=rows < R)
        if COLS:
            tl.atomic_max(camax_ptr + cols, tl.max(a, axis=0), mask=cols < C)

    @triton.jit
    def _cast_rows_cols_kernel(
        x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, ramax_ptr, camax_ptr, R, C, R_OUT, sx_r, sx_c, sq_r, sqt_c,
        FMT_MAX: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
        ROWWISE: tl.constexpr, TRANSPOSE: tl.constexpr,
    ):  # fmt: skip
        # from one loaded tile: q [R_OUT, C] scaled per row (ROWWISE) and qt [C, R_OUT] = x.T scaled per column of x
        # (TRANSPOSE), from the amaxes of the pass before; rows [R, R_OUT) are zeros with an all-zero row's scale
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        row_out, col_ok = rows < R_OUT, cols < C
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * sx_r + cols[None, :].to(tl.int64) * sx_c,
            mask=(rows[:, None] < R) & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        if ROWWISE:
            sr = _scale_of(tl.load(ramax_ptr + rows, mask=rows < R, other=0.0), FMT_MAX, POW2)
            q = _cast(x, _inverse(sr)[:, None], FMT_MAX, OUT)
            tl.store(q_ptr + rows[:, None].to(tl.int64) * sq_r + cols[None, :], q,
                     mask=row_out[:, None] & col_ok[None, :])  # fmt: skip
            if tl.program_id(1) == 0:
                tl.store(s_ptr + rows, sr, mask=row_out)
        if TRANSPOSE:
            sc = _scale_of(tl.load(camax_ptr + cols, mask=col_ok, other=0.0), FMT_MAX, POW2)
            qt = tl.trans(_cast(x, _inverse(sc)[None, :], FMT_MAX, OUT))  # [BC, BR]: contiguous along the rows
            tl.store(qt_ptr + cols[:, None].to(tl.int64) * sqt_c + rows[None, :], qt,
                     mask=col_ok[:, None] & row_out[None, :])  # fmt: skip
            if tl.program_id(0) == 0:
                tl.store(st_ptr + cols, sc, mask=col_ok)


ONE_PASS_MAX = 16384  # widest row the one-pass kernel holds in registers (8 warps: 64 values a thread)
# rows, columns per program, warps: the fastest of experiments/gpu_row_sweep.py's at width 14,336 on an H100 (2026-11-26;
# at width 4,096 within 10% of that width's fastest)
AMAX_TILE = (128, 64, 4)
CAST_TILE = (128, 64, 4)


def quantize_rows_one_pass(
    x: torch.Tensor, fmt: FP8Format, pow2: bool, rows_out: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` (``C <= ONE_PASS_MAX``) with a scale per row, padded to ``rows_out`` rows with zeros: ``(q, s
    [rows_out, 1])``, the bytes and scales of ``kernels.quantize_rows``, reading each row once (the whole row in one
    program's registers)."""
    r, c = x.shape
    if r > rows_out or c > ONE_PASS_MAX:
        raise ValueError(f"quantize_rows_one_pass: {list(x.shape)} does not fit (rows_out {rows_out})")
    q = torch.empty(rows_out, c, dtype=fmt.dtype, device=x.device)
    s = torch.empty(rows_out, 1, dtype=torch.float32, device=x.device)
    if rows_out and c:
        bc = triton.next_power_of_2(c)
        launch_kernel(
            _row_one_pass_kernel, (rows_out,), (x, q, s, r, c, x.stride(0), x.stride(1), c), 8 if bc >= 4096 else 4,
            ("1x", c, "/", rows_out, "x", c, "/", COPIES[True, False]),
            FMT_MAX=fmt.max, POW2=pow2, OUT=_fp8_tl_dtype(fmt), BC=bc,
        )  # fmt: skip
    return q, s


def quantize_rows_cols(
    x: torch.Tensor, fmt: FP8Format, pow2: bool, rows_out: int | None = None, *, rowwise: bool, colwise: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``x [R, C]`` with a scale per row (``q [R_out, C]``, ``s [R_out, 1]``: ``kernels.quantize_rows``) and/or a scale per
    column, written transposed (``qt [C, R_out]``, ``st [C, 1]``: the bytes and scales of ``quantize_rows(x.T)``),
    rows ``[R, R_out)`` zeros.  Two reads of ``x`` for both copies together: the row and column amaxes, then one cast
    pass writing both."""
    r, c, r_out = kernels.padded_shape(x, rows_out, "quantize_rows_cols")
    dev = x.device
    q = torch.empty(r_out, c, dtype=fmt.dtype, device=dev) if rowwise else None
    s = torch.empty(r_out, 1, dtype=torch.float32, device=dev) if rowwise else None
    qt = torch.empty(c, r_out, dtype=fmt.dtype, device=dev) if colwise else None
    st = torch.empty(c, 1, dtype=torch.float32, device=dev) if colwise else None
    if r_out == 0 or c == 0 or not (rowwise or colwise):
        return q, s, qt, st
    ramax = torch.zeros(r_out if rowwise else 1, dtype=torch.float32, device=dev)
    camax = torch.zeros(c if colwise else 1, dtype=torch.float32, device=dev)
    if r:
        br, bc, warps = AMAX_TILE
        launch_kernel(
            _amax_rows_cols_kernel, (triton.cdiv(r, br), triton.cdiv(c, bc)),
            (x, ramax, camax, r, c, x.stride(0), x.stride(1)), warps, BR=br, BC=bc, ROWS=rowwise, COLS=colwise,
        )  # fmt: skip
    br, bc, warps = CAST_TILE
    dummy = x  # the pointer of an output that is not written
    launch_kernel(
        _cast_rows_cols_kernel, (triton.cdiv(r_out, br), triton.cdiv(c, bc)),
        (x, q if q is not None else dummy, s if s is not None else dummy, qt if qt is not None else dummy,
         st if st is not None else dummy, ramax, camax, r, c, r_out, x.stride(0), x.stride(1), c, r_out), warps,
        ("1x", c if rowwise else r_out, "/", r_out, "x", c, "/", COPIES[rowwise, colwise]),
        FMT_MAX=fmt.max, POW2=pow2, OUT=_fp8_tl_dtype(fmt), BR=br, BC=bc, ROWWISE=rowwise, TRANSPOSE=colwise,
    )  # fmt: skip
    return q, s, qt, st


def row_linear_supported(in_features: int, out_features: int, spec: QuantSpec, device: torch.device) -> bool:
    """Whether a linear of this shape and recipe takes the fused row path on ``device``."""
    return (
        spec.granularity == "row"
        and spec.fmt == "e4m3"
        and in_features % 16 == 0
        and out_features % 16 == 0
        and kernels.hopper(device)  # cuBLAS's row-scaled FP8 GEMM as torch calls it: sm_90
    )


def padded_tokens(m: int) -> int:
    """``m`` rounded up to a positive multiple of 16 (the GEMMs' alignment, also where tokens are contracted)."""
    return max(16, math.ceil(m / 16) * 16)


@dataclass(frozen=True)
class RowWeight:
    """A weight's FP8 operands: ``q [N, K]`` with a scale per output channel, ``qt [K, N]`` one per input channel;
    scales ``[N, 1]`` / ``[K, 1]`` (contiguous, so ``.view(1, -1)`` is what the GEMM reads as its B scales)."""

    q: torch.Tensor
    scale: torch.Tensor
    qt: torch.Tensor
    scale_t: torch.Tensor
    key: tuple[int, int]


def quantize_row_weight(w: torch.Tensor, spec: QuantSpec, into: RowWeight | None = None) -> RowWeight:
    """Quantize ``w [N, K]`` per output channel and (transposed) per input channel; ``into``: an earlier result for a
    weight of the same shape whose buffers take the new bytes and scales (what a captured CUDA graph reads)."""
    q, s, qt, st = quantize_rows_cols(w, get_format(spec.fmt), spec.pow2_scales, rowwise=True, colwise=True)
    assert q is not None and s is not None and qt is not None and st is not None
    key = (w.data_ptr(), w._version)
    if into is None:
        return RowWeight(q, s, qt, st, key)
    if into.q.shape != q.shape:
        raise ValueError(f"cannot requantize a {list(w.shape)} weight into operands of shape {list(into.q.shape)}")
    for old, new in ((into.q, q), (into.scale, s), (into.qt, qt), (into.scale_t, st)):
        old.copy_(new)
    return RowWeight(into.q, into.scale, into.qt, into.scale_t, key)


def quantize_row_input(
    x2: torch.Tensor, spec: QuantSpec, rowwise: bool = True, colwise: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``x2 [M, K]`` (activations or gradients, tokens first) padded to ``padded_tokens(M)`` rows: ``(q [Mp, K],
    s [Mp, 1], qt [K, Mp], st [K, 1])``, the copies not asked for None; the row copy alone in one read."""
    fmt, mp = get_format(spec.fmt), padded_tokens(x2.shape[0])
    if rowwise and not colwise and x2.shape[1] <= ONE_PASS_MAX:
        q, s = quantize_rows_one_pass(x2, fmt, spec.pow2_scales, mp)
        return q, s, None, None
    return quantize_rows_cols(x2, fmt, spec.pow2_scales, mp, rowwise=rowwise, colwise=colwise)


def row_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """``(a @ b.T)[:rows]`` in bf16 for row-scaled e4m3 ``a [M, K]`` (``a_scale [M, 1]``) and ``b [N, K]``
    (``b_scale [N, 1]``)."""
    out = torch._scaled_mm(a, b.t(), a_scale, b_scale.view(1, -1), out_dtype=torch.bfloat16)
    return out[:rows]
