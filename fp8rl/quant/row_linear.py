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
the forward's ``W`` copy.  The GEMMs are ``torch._scaled_mm`` with row-wise scales (CUTLASS on sm_90), which run
Llama-8B shapes faster than the 1x128 / 128x128 block-scaled ones (``fp8rl bench kernels``).

The copies along the tokens (``dY.T``, ``X.T``) cannot be made in one pass: a column's scale needs the whole
column's amax first.  ``quantize_cols`` reads the input twice (an amax pass with an atomic max per column, then a
cast that writes the transposed bytes); the forward saves ``X`` itself (under activation checkpointing the
recompute's copy, which the layer holds anyway) and the backward makes ``X.T``'s FP8 copy from it.
Token counts are padded with zero rows to a multiple of 16 (cuBLAS / CUTLASS), which changes no scale of a real row
or column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8rl.quant import kernels
from fp8rl.quant.formats import FP8Format, get_format
from fp8rl.quant.kernels import COPIES, _launch, triton
from fp8rl.quant.quantize import QuantSpec

if triton is not None:
    import triton.language as tl

    from fp8rl.quant.kernels import _abs_nan_as_inf, _cast, _fp8_tl_dtype, _inverse, _scale_of

    @triton.jit
    def _col_amax_kernel(x_ptr, amax_ptr, R, C, sx_r, sx_c, BR: tl.constexpr, BC: tl.constexpr):
        # amax_ptr [C] starts at zero; each program folds its BR x BC tile's column maxima in (|x| >= 0, so a float
        # atomic max is exact and order-free)
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        ok = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx_r + cols[None, :].to(tl.int64) * sx_c, mask=ok, other=0.0)
        tl.atomic_max(amax_ptr + cols, tl.max(_abs_nan_as_inf(x.to(tl.float32)), axis=0), mask=cols < C)

    @triton.jit
    def _cast_cols_kernel(
        x_ptr, qt_ptr, amax_ptr, s_ptr, R, C, R_OUT, sx_r, sx_c, sqt_c,
        FMT_MAX: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        # qt [C, R_OUT] = the FP8 bytes of x.T, row c scaled by column c's amax; rows [R, R_OUT) of x read as zeros
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        col_ok = cols < C
        s = _scale_of(tl.load(amax_ptr + cols, mask=col_ok, other=0.0), FMT_MAX, POW2)
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * sx_r + cols[None, :].to(tl.int64) * sx_c,
            mask=(rows[:, None] < R) & col_ok[None, :],
            other=0.0,
        )
        q = tl.trans(_cast(x.to(tl.float32), _inverse(s)[None, :], FMT_MAX, OUT))  # [BC, BR]: rows contiguous
        tl.store(
            qt_ptr + cols[:, None].to(tl.int64) * sqt_c + rows[None, :], q,
            mask=col_ok[:, None] & (rows[None, :] < R_OUT),
        )  # fmt: skip
        if tl.program_id(0) == 0:
            tl.store(s_ptr + cols, s, mask=col_ok)


AMAX_TILE = (256, 64, 4)  # rows, columns per program, warps
CAST_TILE = (64, 64, 4)


def quantize_cols(
    x: torch.Tensor, fmt: FP8Format, pow2: bool, rows_out: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` quantized along its columns and written transposed: ``(qt [C, R_out], s [C, 1])``, the bytes and
    scales of ``quantize_rows(x.T)`` (one scale per column of ``x``, over all its rows), rows ``[R, R_out)`` of ``x``
    taken as zeros.  Two reads of ``x``: the column amaxes, then the cast."""
    if x.dim() != 2:
        raise ValueError(f"quantize_cols needs a 2-D tensor, got shape {tuple(x.shape)}")
    r, c = x.shape
    r_out = r if rows_out is None else rows_out
    if r_out < r:
        raise ValueError(f"rows_out ({r_out}) must be at least the row count ({r})")
    qt = torch.empty(c, r_out, dtype=fmt.dtype, device=x.device)
    s = torch.empty(c, 1, dtype=torch.float32, device=x.device)
    if c == 0:
        return qt, s
    amax = torch.zeros(c, dtype=torch.float32, device=x.device)
    if r:
        br, bc, warps = AMAX_TILE
        grid = (triton.cdiv(r, br), triton.cdiv(c, bc))
        _launch(_col_amax_kernel, grid, (x, amax, r, c, x.stride(0), x.stride(1)), warps, BR=br, BC=bc)
    br, bc, warps = CAST_TILE
    _launch(
        _cast_cols_kernel, (max(1, triton.cdiv(r_out, br)), triton.cdiv(c, bc)),
        (x, qt, amax, s, r, c, r_out, x.stride(0), x.stride(1), r_out), warps,
        ("1x", r_out, "/", c, "x", r_out, "/", COPIES[False, True]),
        FMT_MAX=fmt.max, POW2=pow2, OUT=_fp8_tl_dtype(fmt), BR=br, BC=bc,
    )  # fmt: skip
    return qt, s


def row_linear_supported(in_features: int, out_features: int, spec: QuantSpec, device: torch.device) -> bool:
    """Whether a linear of this shape and recipe takes the fused row path on ``device``."""
    if device.type != "cuda" or triton is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (
        kernels.cuda_capability(index)[0] == 9  # torch's row-wise scaled GEMM: sm_90
        and spec.granularity == "row"
        and spec.fmt == "e4m3"
        and in_features % 16 == 0
        and out_features % 16 == 0
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
    fmt = get_format(spec.fmt)
    q, s = kernels.quantize_rows(w, fmt, spec.pow2_scales, rows_out=w.shape[0])
    qt, st = quantize_cols(w, fmt, spec.pow2_scales)
    key = (w.data_ptr(), w._version)
    if into is None:
        return RowWeight(q, s, qt, st, key)
    if into.q.shape != q.shape:
        raise ValueError(f"cannot requantize a {list(w.shape)} weight into operands of shape {list(into.q.shape)}")
    for old, new in ((into.q, q), (into.scale, s), (into.qt, qt), (into.scale_t, st)):
        old.copy_(new)
    return RowWeight(into.q, into.scale, into.qt, into.scale_t, key)


def quantize_row_input(x2: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2 [M, K]`` with a scale per row, padded to ``padded_tokens(M)`` rows: ``(q, s [Mp, 1])``."""
    return kernels.quantize_rows(x2, get_format(spec.fmt), spec.pow2_scales, rows_out=padded_tokens(x2.shape[0]))


def quantize_col_input(x2: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2 [M, K]`` with a scale per column over the tokens, transposed and padded: ``(qt [K, Mp], s [K, 1])``."""
    return quantize_cols(x2, get_format(spec.fmt), spec.pow2_scales, rows_out=padded_tokens(x2.shape[0]))


def row_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """``(a @ b.T)[:rows]`` in bf16 for row-scaled e4m3 ``a [M, K]`` (``a_scale [M, 1]``) and ``b [N, K]``
    (``b_scale [N, 1]``)."""
    out = torch._scaled_mm(a, b.t(), a_scale, b_scale.view(1, -1), out_dtype=torch.bfloat16)
    return out[:rows]
