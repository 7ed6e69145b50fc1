"""Quantize and dequantize at tensor, row and block granularity (see the package docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fp8rl.quant.formats import FP8Format, get_format
from fp8rl.quant.scaling import scale_from_amax

Granularity = Literal["tensor", "row", "block"]
GRANULARITIES: tuple[str, ...] = ("tensor", "row", "block")


class NonFiniteError(ValueError):
    """The input to a quantizer holds NaN or Inf, which would poison its scales."""


@dataclass(frozen=True)
class QuantSpec:
    """How a recipe quantizes: granularity, format, block sizes and scale rounding.

    ``weight_block`` is the (rows, cols) tile of a weight ``[out, in]``; activations
    and gradients use 1 x ``act_block`` groups along their last dimension.
    """

    granularity: Granularity = "block"
    fmt: str = "e4m3"
    weight_block: tuple[int, int] = (128, 128)
    act_block: int = 128
    pow2_scales: bool = False

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        get_format(self.fmt)
        if min(self.weight_block) < 1 or self.act_block < 1:
            raise ValueError(f"block sizes must be positive, got {self.weight_block} and {self.act_block}")


@dataclass(frozen=True)
class QuantizedTensor:
    """FP8 values and their float32 dequantization multipliers.

    ``data`` has the shape of the source tensor.  ``scale_inv`` has shape ``()``
    (tensor), ``[..., 1]`` (row), ``[ceil(R/br), ceil(C/bc)]`` (2-D block) or
    ``[..., ceil(K/bc)]`` (1 x bc groups).  ``block`` is None for tensor and row
    granularity, else the group shape over the last two dimensions.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    granularity: Granularity
    fmt: FP8Format
    block: tuple[int, int] | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        """Bytes held: FP8 values plus scales."""
        return self.data.numel() * self.data.element_size() + self.scale_inv.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)


def _check_finite(amax: torch.Tensor, what: str) -> None:
    # amax propagates NaN and Inf, so checking the (small) amax tensor is enough.
    if not bool(torch.isfinite(amax).all()):
        bad = int((~torch.isfinite(amax)).sum())
        raise NonFiniteError(f"{what}: input holds NaN or Inf ({bad} scale group(s) affected); refusing to quantize")


def _cast(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    return (x / scale).clamp_(-fmt.max, fmt.max).to(fmt.dtype)


def _require_float(x: torch.Tensor) -> torch.Tensor:
    if not x.dtype.is_floating_point or x.element_size() == 1:
        raise TypeError(f"can only quantize float16/bfloat16/float32/float64 tensors, got {x.dtype}")
    return x.to(torch.float32)


def quantize_tensorwise(x: torch.Tensor, fmt: str | FP8Format = "e4m3", pow2: bool = False) -> QuantizedTensor:
    """One scale for the whole tensor; ``scale_inv`` has shape ``()``."""
    f = get_format(fmt)
    xf = _require_float(x)
    amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
    _check_finite(amax, "quantize_tensorwise")
    scale = scale_from_amax(amax, f, pow2)
    return QuantizedTensor(_cast(xf, scale, f), scale, "tensor", f)


def quantize_rowwise(x: torch.Tensor, fmt: str | FP8Format = "e4m3", pow2: bool = False) -> QuantizedTensor:
    """One scale per row of the last dimension; ``scale_inv`` has shape ``[..., 1]``.

    For a weight ``[out, in]`` this is per output channel; for activations
    ``[tokens, in]`` it is per token.
    """
    f = get_format(fmt)
    xf = _require_float(x)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    _check_finite(amax, "quantize_rowwise")
    scale = scale_from_amax(amax, f, pow2)
    return QuantizedTensor(_cast(xf, scale, f), scale, "row", f)


def quantize_blockwise(
    x: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    fmt: str | FP8Format = "e4m3",
    pow2: bool = False,
) -> QuantizedTensor:
    """Quantize in tiles of ``block`` over the last two dimensions.

    ``block = (br, bc)`` with ``br > 1`` needs a 2-D input ``[R, C]`` and gives
    ``scale_inv [ceil(R/br), ceil(C/bc)]`` (weights, 128x128).  ``br == 1`` accepts
    any leading dimensions ``[..., K]`` and gives ``scale_inv [..., ceil(K/bc)]``
    (activations and gradients, 1x128).  Partial edge blocks are zero-padded for
    the amax, which does not change it, and cropped afterwards.
    """
    f = get_format(fmt)
    br, bc = block
    xf = _require_float(x)
    if br != 1 and xf.dim() != 2:
        raise ValueError(f"{br}x{bc} block quantization needs a 2-D tensor, got shape {tuple(x.shape)}")
    if xf.dim() == 0:
        raise ValueError("block quantization needs at least one dimension")
    lead = xf.shape[:-1]
    cols = xf.shape[-1]
    x2 = xf.reshape(-1, cols)
    rows = x2.shape[0]
    n_r, n_c = math.ceil(rows / br), math.ceil(cols / bc)
    padded = F.pad(x2, (0, n_c * bc - cols, 0, n_r * br - rows))
    tiles = padded.view(n_r, br, n_c, bc)
    amax = tiles.abs().amax(dim=(1, 3))
    _check_finite(amax, "quantize_blockwise")
    scale = scale_from_amax(amax, f, pow2)
    q = _cast(tiles, scale[:, None, :, None], f).view(n_r * br, n_c * bc)[:rows, :cols]
    q = q.reshape(*lead, cols).contiguous()
    if br == 1:
        scale = scale.reshape(*lead, n_c)
    return QuantizedTensor(q, scale.contiguous(), "block", f, (br, bc))


def quantize(
    x: torch.Tensor,
    granularity: Granularity,
    fmt: str | FP8Format = "e4m3",
    block: tuple[int, int] = (128, 128),
    pow2: bool = False,
) -> QuantizedTensor:
    """Quantize ``x`` at ``granularity`` (``block`` is used only for ``"block"``)."""
    if granularity == "tensor":
        return quantize_tensorwise(x, fmt, pow2)
    if granularity == "row":
        return quantize_rowwise(x, fmt, pow2)
    if granularity == "block":
        return quantize_blockwise(x, block, fmt, pow2)
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def quantize_weight(w: torch.Tensor, spec: QuantSpec) -> QuantizedTensor:
    """Quantize a weight ``[out, in]`` per ``spec`` (128x128 tiles for ``block``)."""
    return quantize(w, spec.granularity, spec.fmt, spec.weight_block, spec.pow2_scales)


def quantize_activation(x: torch.Tensor, spec: QuantSpec) -> QuantizedTensor:
    """Quantize activations or gradients ``[..., K]`` per ``spec`` (1 x act_block groups)."""
    return quantize(x, spec.granularity, spec.fmt, (1, spec.act_block), spec.pow2_scales)


def expand_scale(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int] | None) -> torch.Tensor:
    """Broadcast a scale grid to ``shape`` (one multiplier per element)."""
    if block is None:
        return scale
    br, bc = block
    s = scale.repeat_interleave(bc, dim=-1)[..., : shape[-1]]
    if br != 1:
        s = s.repeat_interleave(br, dim=-2)[: shape[-2], :]
    return s


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.data * q.scale_inv`` computed in float32, rounded once to ``dtype``."""
    s = expand_scale(q.scale_inv, q.data.shape, q.block)
    return (q.data.to(torch.float32) * s).to(dtype)
