"""Scale computation: amax -> dequantization multiplier, optionally a power of two."""

from __future__ import annotations

import torch

from fp8rl.quant.formats import FP8Format

# Floor on a group's amax so all-zero groups get a finite, positive scale
# (the epsilon of vLLM's per-token-group FP8 quantization).
AMAX_FLOOR = 1e-10

_MANTISSA_MASK = (1 << 23) - 1


def round_scale_up_to_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Round positive normal float32 scales up to the next power of two (exact).

    Works on the IEEE-754 bit pattern: a float32 with a zero mantissa field is
    already 2^e; otherwise the result is 2^(e+1).  Integer arithmetic only, so the
    result is identical on every device (``log2``/``ceil`` could differ by an ulp
    near powers of two between CPU and CUDA libm).
    """
    if scale.dtype != torch.float32:
        raise TypeError(f"scale must be float32, got {scale.dtype}")
    bits = scale.contiguous().view(torch.int32)
    exponent = bits >> 23  # sign bit is 0 for positive scales
    has_mantissa = (bits & _MANTISSA_MASK) != 0
    exponent = exponent + has_mantissa.to(torch.int32)
    return (exponent << 23).view(torch.float32).view(scale.shape)


def scale_from_amax(amax: torch.Tensor, fmt: FP8Format, pow2: bool = False) -> torch.Tensor:
    """Dequantization multiplier for groups with absolute maximum ``amax``.

    ``s = max(amax, AMAX_FLOOR) / fmt.max`` in float32, rounded up to a power of two
    when ``pow2`` (2^ceil(log2(amax / fmt_max)), so ``amax / s <= fmt_max`` still holds).
    """
    amax = amax.to(torch.float32).clamp(min=AMAX_FLOOR)
    # Divide by a device tensor, not a Python number: CUDA kernels turn division by a
    # host scalar into multiplication by its reciprocal, which rounds differently
    # from the IEEE division the CPU performs (measured on an H100: 21 of 40 cases
    # differed in some bytes).  Tensor / tensor division is IEEE-exact on both.
    scale = amax / amax.new_full((), fmt.max)
    if pow2:
        scale = round_scale_up_to_pow2(scale)
    return scale
