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
    multiple of 16, and for 1x128 x 128x128 blocks K and N multiples of 128 on sm_90.
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
        if x.block != (1, 128) or w.block != (128, 128) or k % 128 or n % 128:
            return "emulated"
        if torch.cuda.get_device_capability(x.data.device)[0] != 9:
            return "emulated"  # cuBLAS 1x128 x 128x128 block scaling is a Hopper feature
    return "scaled_mm"


def _block_scales_for_cublas(x: QuantizedTensor, w: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    # cuBLAS on sm_90 wants the 1x128 activation scales "outer-dim major" ([M, K/128]
    # with stride (1, M)) and the 128x128 weight scales as [K/128 padded to 4, N/128]
    # outer-dim major, as torch's own scaled_mm tests lay them out.
    m = x.data.shape[0]
    n_blocks, k_blocks = w.scale_inv.shape
    scale_a = x.scale_inv.t().contiguous().t()
    padded_k = 4 * math.ceil(k_blocks / 4)
    scale_b = torch.zeros(n_blocks, padded_k, dtype=torch.float32, device=w.scale_inv.device)
    scale_b[:, :k_blocks] = w.scale_inv
    assert scale_a.shape == (m, k_blocks)
    return scale_a, scale_b.t()


def _scaled_mm(x: QuantizedTensor, w: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    mat_b = w.data.t()  # [K, N], column-major as cuBLAS requires
    if x.granularity == "tensor":
        return torch._scaled_mm(x.data, mat_b, x.scale_inv, w.scale_inv, out_dtype=out_dtype)
    if x.granularity == "row":
        # cuBLAS row-wise scaling produces bf16 only.
        out = torch._scaled_mm(x.data, mat_b, x.scale_inv, w.scale_inv.reshape(1, -1), out_dtype=torch.bfloat16)
        return out.to(out_dtype)
    scale_a, scale_b = _block_scales_for_cublas(x, w)
    out = F.scaled_mm(
        x.data,
        mat_b,
        scale_a,
        F.ScalingType.BlockWise1x128,
        scale_b,
        F.ScalingType.BlockWise128x128,
        swizzle_a=F.SwizzleType.NO_SWIZZLE,
        swizzle_b=F.SwizzleType.NO_SWIZZLE,
        output_dtype=torch.bfloat16,
    )
    return out.to(out_dtype)


def fp8_gemm(
    x: QuantizedTensor,
    w: QuantizedTensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    backend: GemmBackend | None = None,
) -> torch.Tensor:
    """``dequant(x) @ dequant(w).T (+ bias)`` with FP32 accumulation.

    Shapes: ``x.data [M, K]`` (activations, 1 x block groups), ``w.data [N, K]``
    (weights), result ``[M, N]`` in ``out_dtype``.  ``backend`` forces a path;
    by default :func:`fp8_gemm_backend` chooses.
    """
    if x.data.shape[-1] != w.data.shape[-1]:
        raise ValueError(f"inner dimensions differ: x {tuple(x.data.shape)} vs w {tuple(w.data.shape)}")
    chosen = backend or fp8_gemm_backend(x, w)
    if chosen == "scaled_mm":
        out = _scaled_mm(x, w, out_dtype)
    else:
        out = (dequantize(x) @ dequantize(w).t()).to(out_dtype)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out
