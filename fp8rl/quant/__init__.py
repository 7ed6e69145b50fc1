"""FP8 numerics: formats, scaling granularities, quantize / dequantize, FP8 GEMM.

Everything in fp8rl that quantizes -- checkpoint conversion, the rollout engines'
FP8 weights, the trainer's FP8 linear, the requantized weight sync -- goes through
this package, so "the same recipe" means the same bytes.  It imports nothing else
of the project.

Formats (OCP FP8, as ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``)
    e4m3: 4 exponent bits, 3 mantissa bits, bias 7, no infinities; max 448,
          smallest normal 2^-6, smallest subnormal 2^-9.  Used for weights,
          activations and (by default) gradients, as DeepSeek-V3 and
          TransformerEngine's Float8BlockScaling do.
    e5m2: 5 exponent bits, 2 mantissa bits, bias 15; max 57344, smallest normal
          2^-14, smallest subnormal 2^-16.  Wider range, coarser steps.

Scales
    One scale per group of elements.  For a group with absolute maximum ``amax``:

        s = max(amax, 1e-10) / fmt_max            (float32)
        s = 2 ** ceil(log2(s))                    (optional, ``pow2_scales``)
        q = fp8(clamp(x * (1 / s), -fmt_max, fmt_max))  (round to nearest even)
        x ~= q * s

    ``s`` is stored as the *dequantization multiplier*, called ``weight_scale_inv``
    in the DeepSeek-V3 / vLLM block-FP8 checkpoint format and ``weight_scale`` in
    compressed-tensors.  The 1e-10 floor keeps all-zero groups finite (vLLM's
    per-token-group quantization uses the same epsilon).  The power-of-two rounding
    is done on the float32 bit pattern, so it is exact and identical on every
    device; the reciprocal ``1 / s`` (one IEEE division per group) and the product ``x * (1 / s)`` are IEEE
    float32 on CPU and CUDA alike, so a CUDA tensor quantizes to the same bytes as a CPU tensor.  (A multiply
    per value, not a division: the fused kernels are otherwise bound by instruction issue; ``x * (1 / s)``
    differs from ``x / s`` by at most one float32 ulp before the FP8 rounding, and ``pow2`` scales not at all.)  Inputs holding NaN or Inf
    raise :class:`NonFiniteError` instead of producing NaN scales.

Granularities (``granularity``), for a weight W[out, in] and activations X[..., in]
    tensor: one scale for the whole tensor; scale shape ``()``.
    row:    one scale per row of the last dimension -- per output channel for
            weights (scale ``[out, 1]``), per token for activations
            (``[..., 1]``), as compressed-tensors "channel"/"token".
    block:  weights in 128x128 tiles (scale ``[ceil(out/128), ceil(in/128)]``),
            activations in 1x128 groups along the reduction dimension (scale
            ``[..., ceil(in/128)]``), as DeepSeek-V3, vLLM ``weight_block_size``
            and TransformerEngine Float8BlockScaling.  Shapes that are not a
            multiple of the block use the ceil-div grid: the last block is partial
            and its amax covers only the real elements.

Kernels
    On CUDA (sm_89+, with Triton) the quantizers run fused Triton kernels (``fp8rl.quant.kernels``):
    one pass over the input that writes the FP8 bytes and the scales, byte-identical to the torch
    reference (``backend="torch"``), which stays the CPU path and the oracle of the GPU tests.  The
    training linear's fast path (``fp8rl.quant.block_linear``) also writes, in the same launch or one
    beside it, the transposed copy the wgrad GEMM contracts over, and the cuBLAS scale layouts.

GEMM
    :func:`fp8_gemm` computes ``X @ W.T`` from two quantized operands.  On CUDA with
    FP8 tensor cores it calls torch's scaled matmul (FP8 inputs, FP32 accumulation);
    elsewhere it emulates that GEMM exactly in the sense that matters: the same FP8
    values and scales, dequantized and multiplied with FP32 accumulation.  The two
    differ only by FP32 summation order.
"""

from fp8rl.quant import kernels
from fp8rl.quant.formats import E4M3, E5M2, FP8Format, get_format
from fp8rl.quant.gemm import fp8_gemm, fp8_gemm_backend
from fp8rl.quant.quantize import (
    Granularity,
    NonFiniteError,
    QuantizedTensor,
    QuantSpec,
    dequantize,
    quantize,
    quantize_activation,
    quantize_blockwise,
    quantize_rowwise,
    quantize_tensorwise,
    quantize_weight,
)
from fp8rl.quant.scaling import AMAX_FLOOR, round_scale_up_to_pow2, scale_from_amax

__all__ = [
    "AMAX_FLOOR",
    "E4M3",
    "E5M2",
    "FP8Format",
    "Granularity",
    "NonFiniteError",
    "QuantSpec",
    "QuantizedTensor",
    "dequantize",
    "fp8_gemm",
    "fp8_gemm_backend",
    "get_format",
    "kernels",
    "quantize",
    "quantize_activation",
    "quantize_blockwise",
    "quantize_rowwise",
    "quantize_tensorwise",
    "quantize_weight",
    "round_scale_up_to_pow2",
    "scale_from_amax",
]
