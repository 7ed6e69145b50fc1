"""The fast path of an FP8 linear under the block recipe on Hopper: fused quantization + cuBLAS block GEMMs.

The three GEMMs of a linear ``Y = X @ W.T`` (X ``[M, K]``, W ``[N, K]``) and the operands each needs:

    forward  Y  = X  @ W.T     X: 1x128 along K (rowwise)      W:   128x128 tiles
    dgrad    dX = dY @ W       dY: 1x128 along N (rowwise)     W.T: 128x128 tiles (= tiles of W, transposed)
    wgrad    dW = dY.T @ X     dY.T, X.T: 1x128 along M (colwise: the transposed bytes)

so one fused pass over X gives its rowwise and colwise FP8 copies (the colwise one is what the
backward keeps instead of X), one pass over dY gives both of its copies, and the weight is
quantized once per weight version (once per optimizer step, not per micro-batch) together with its
transpose.  The bytes are those of the reference quantizers (``quantize_activation(x)``,
``quantize_activation(x.T)``, ``quantize_weight(w)``, ``quantize_weight(w.T)``): only the GEMMs'
summation order differs from the emulated CPU path.

Token counts are padded with zero rows to a multiple of 16 (128 where the wgrad contracts over them;
zero rows change no group's amax and add nothing to the wgrad sum), so any M takes this path; K and N
must be multiples of 128.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8rl.quant import kernels
from fp8rl.quant.formats import get_format
from fp8rl.quant.gemm import block_scaled_mm, tile_scale_buffer
from fp8rl.quant.quantize import QuantSpec


def block_linear_supported(in_features: int, out_features: int, spec: QuantSpec, device: torch.device) -> bool:
    """Whether a linear of this shape and recipe takes the fused path on ``device``."""
    return (
        spec.granularity == "block"
        and spec.fmt == "e4m3"
        and spec.act_block == 128
        and tuple(spec.weight_block) == (128, 128)
        and in_features % 128 == 0
        and out_features % 128 == 0
        and kernels.hopper(device)  # cuBLAS 1x128 / 128x128 block scaling: Hopper only
    )


@dataclass(frozen=True)
class BlockWeight:
    """A weight's FP8 operands: ``q [N, K]`` with tile scales, and for the backward ``qt [K, N]``."""

    q: torch.Tensor
    scale: torch.Tensor  # [N/128, K/128] row-major view (the reference's scale_inv)
    scale_cublas: torch.Tensor
    qt: torch.Tensor | None
    scale_t: torch.Tensor | None  # [K/128, N/128] row-major view of scale_t_cublas
    scale_t_cublas: torch.Tensor | None
    key: tuple[int, int]


def quantize_block_weight(
    w: torch.Tensor, spec: QuantSpec, transpose: bool, into: BlockWeight | None = None
) -> BlockWeight:
    """Quantize ``w [N, K]`` in 128x128 tiles (and its transpose) straight into cuBLAS's scale layouts.

    ``into``: an earlier result for a weight of the same shape whose buffers take the new bytes and scales in
    place (what a captured CUDA graph reads stays where it is); the returned operands alias them."""
    n, k = w.shape
    nb, kb = math.ceil(n / 128), math.ceil(k / 128)
    if into is not None:
        if tuple(into.q.shape) != (n, k) or transpose != (into.qt is not None):
            raise ValueError(f"cannot requantize a [{n}, {k}] weight into operands of shape {list(into.q.shape)}")
        s_view, s_cublas, st_view, st_cublas = into.scale, into.scale_cublas, into.scale_t, into.scale_t_cublas
    else:
        s_view, s_cublas = tile_scale_buffer(nb, kb, w.device)
        st_view, st_cublas = tile_scale_buffer(kb, nb, w.device) if transpose else (None, None)
    q, _, qt, _ = kernels.quantize_tiles(
        w, get_format(spec.fmt), spec.pow2_scales, (128, 128), transpose=transpose, scale_out=s_view,
        scale_t_out=st_view, q_out=None if into is None else into.q, qt_out=None if into is None else into.qt,
    )  # fmt: skip
    return BlockWeight(q, s_view, s_cublas, qt, st_view, st_cublas, (w.data_ptr(), w._version))


def padded_rows(m: int, multiple: int) -> int:
    """``m`` rounded up to a positive multiple of ``multiple`` (cuBLAS: 16 rows; wgrad contraction: 128)."""
    return max(multiple, math.ceil(m / multiple) * multiple)


def block_input_rows(m: int, wgrad: bool) -> int:
    """The rows ``quantize_block_input`` pads ``m`` to: 128s where the input feeds a wgrad GEMM (its reduction runs
    over the rows), else 16s (cuBLAS)."""
    return padded_rows(m, 128 if wgrad else 16)


def quantize_block_input(
    x2: torch.Tensor, spec: QuantSpec, rowwise: bool, colwise: bool, wgrad_rows: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """One pass over ``x2 [M, K]``: ``(q [Mp, K], s, qt [K, Mp], st)`` with scales outer-major for cuBLAS.

    ``Mp = block_input_rows(M, colwise or wgrad_rows)``: ``wgrad_rows`` pads as the transposed copy needs without
    making it."""
    return kernels.quantize_groups(
        x2, get_format(spec.fmt), spec.pow2_scales, 128, rowwise=rowwise, colwise=colwise,
        rows_out=block_input_rows(x2.shape[0], colwise or wgrad_rows), outer_major_scales=True,
    )  # fmt: skip


def block_mm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """``(a @ w.T)[:rows]`` for a padded 1x128-scaled ``a`` and a 128x128-tiled ``w`` (bf16)."""
    return block_scaled_mm(a, a_scale, w, w_scale, b_tiles=True)[:rows]


def block_wgrad(gt: torch.Tensor, gt_scale: torch.Tensor, xt: torch.Tensor, xt_scale: torch.Tensor) -> torch.Tensor:
    """``dW = dY.T @ X`` from the colwise copies ``gt [N, Mp]`` and ``xt [K, Mp]`` (1x128 x 1x128, bf16)."""
    return block_scaled_mm(gt, gt_scale, xt, xt_scale, b_tiles=False)
