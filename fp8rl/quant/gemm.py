"""FP8 GEMM ``Y = X @ W.T`` from quantized operands: tensor cores on Hopper, exact emulation elsewhere.

Both paths consume the same :class:`QuantizedTensor` values.  The emulated path
dequantizes to float32 and multiplies with float32 accumulation, which is what the
FP8 tensor-core GEMM computes up to summation order; it is the CPU path and the
reference the GPU path is tested against.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from fp8rl.quant.quantize import QuantizedTensor, dequantize

GemmBackend = Literal["scaled_mm", "emulated"]


def _fp8_tensor_cores(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return (major, minor) >= (8, 9)


def fp8_gemm_backend(x: QuantizedTensor, w: QuantizedTensor) -> GemmBackend:
    """Which path :func:`fp8_gemm` takes for these operands.

    ``scaled_mm`` needs a CUDA device with FP8 tensor cores (sm_89+), e4m3 operands
    with the same granularity, and the alignments cuBLAS asks for: every dimension a
    multiple of 16, and for block scaling (sm_90 only) K and N multiples of 128 with
    the activations in 1x128 groups and the weight in 128x128 tiles (forward, dgrad) or
    1x128 groups too (wgrad, where both operands are grouped along the tokens).
    """
    if not _fp8_tensor_cores(x.data.device) or x.fmt.name != "e4m3" or w.fmt.name != "e4m3":
        return "emulated"
    if x.data.dim() != 2 or w.data.dim() != 2 or x.granularity != w.granularity:
        return "emulated"
    m, k = x.data.shape
    n = w.data.shape[0]
    if m % 16 or k % 16 or n % 16:
        return "emulated"
    if x.granularity == "block":
        if x.block != (1, 128) or w.block not in ((128, 128), (1, 128)) or k % 128 or n % 128:
            return "emulated"
        if torch.cuda.get_device_capability(x.data.device)[0] != 9:
            return "emulated"  # cuBLAS 1x128 x 128x128 block scaling is a Hopper feature
    return "scaled_mm"


def outer_major(scale: torch.Tensor) -> torch.Tensor:
    """1x128 group scales ``[rows, K/128]`` laid out with stride ``(1, rows)``, as cuBLAS reads them (no copy if so)."""
    return scale.t().contiguous().t()


def tile_scale_buffer(n_blocks: int, k_blocks: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed buffer for 128x128 tile scales in cuBLAS's layout: ``(view [n_blocks, k_blocks], for_cublas)``.

    cuBLAS on sm_90 reads 128x128 weight scales as ``[ceil4(K/128), N/128]`` with stride ``(1, ceil4(K/128))``
    (the K-block count padded to a multiple of 4).  Quantizers write the row-major ``view``; the GEMM gets
    ``for_cublas``.  Both alias one allocation.
    """
    padded_k = 4 * math.ceil(k_blocks / 4)
    buf = torch.zeros(n_blocks, padded_k, dtype=torch.float32, device=device)
    return buf[:, :k_blocks], buf.t()


def tile_scales_for_cublas(scale: torch.Tensor) -> torch.Tensor:
    """128x128 tile scales ``[N/128, K/128]`` copied into cuBLAS's padded layout (see ``tile_scale_buffer``)."""
    view, for_cublas = tile_scale_buffer(scale.shape[0], scale.shape[1], scale.device)
    view.copy_(scale)
    return for_cublas


def block_scaled_mm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, b_tiles: bool
) -> torch.Tensor:
    """``A @ B.T`` in bf16 from block-scaled e4m3 operands on sm_90 (cuBLAS through ``F.scaled_mm``).

    ``a [M, K]`` with 1x128 scales ``a_scale [M, K/128]`` of stride ``(1, M)``; ``b [N, K]`` with either
    128x128 tile scales in cuBLAS's layout (``b_tiles``; ``tile_scale_buffer``) or 1x128 group scales
    ``[N, K/128]`` of stride ``(1, N)``.  M, N multiples of 16, K and N multiples of 128.
    """
    return F.scaled_mm(
        a,
        b.t(),
        a_scale,
        F.ScalingType.BlockWise1x128,
        b_scale,
        F.ScalingType.BlockWise128x128 if b_tiles else F.ScalingType.BlockWise1x128,
        swizzle_a=F.SwizzleType.NO_SWIZZLE,
        swizzle_b=F.SwizzleType.NO_SWIZZLE,
        output_dtype=torch.bfloat16,
    )


def _scaled_mm(x: QuantizedTensor, w: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    mat_b = w.data.t()  # [K, N], column-major as cuBLAS requires
    if x.granularity == "tensor":
        return torch._scaled_mm(x.data, mat_b, x.scale_inv, w.scale_inv, out_dtype=out_dtype)
    if x.granularity == "row":
        # cuBLAS row-wise scaling produces bf16 only.
        out = torch._scaled_mm(x.data, mat_b, x.scale_inv, w.scale_inv.reshape(1, -1), out_dtype=torch.bfloat16)
        return out.to(out_dtype)
    tiles = w.block == (128, 128)
    scale_b = tile_scales_for_cublas(w.scale_inv) if tiles else outer_major(w.scale_inv)
    return block_scaled_mm(x.data, outer_major(x.scale_inv), w.data, scale_b, tiles).to(out_dtype)


def fp8_gemm(
    x: QuantizedTensor,
    w: QuantizedTensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    backend: GemmBackend | None = None,
    w_dequantized: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dequant(x) @ dequant(w).T (+ bias)`` with FP32 accumulation.

    Shapes: ``x.data [M, K]`` (activations, 1 x block groups), ``w.data [N, K]``
    (weights), result ``[M, N]`` in ``out_dtype``.  ``backend`` forces a path;
    by default :func:`fp8_gemm_backend` chooses.  ``w_dequantized``: ``dequantize(w)`` (float32) computed
    once by a caller whose weight does not change between calls; the emulated path uses it instead of
    dequantizing ``w`` again (the same numbers).
    """
    if x.data.shape[-1] != w.data.shape[-1]:
        raise ValueError(f"inner dimensions differ: x {tuple(x.data.shape)} vs w {tuple(w.data.shape)}")
    chosen = backend or fp8_gemm_backend(x, w)
    if chosen == "scaled_mm":
        out = _scaled_mm(x, w, out_dtype)
    else:
        dense_w = dequantize(w) if w_dequantized is None else w_dequantized
        out = (dequantize(x) @ dense_w.t()).to(out_dtype)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out
