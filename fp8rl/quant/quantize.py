"""Quantize and dequantize at tensor, row and block granularity (see the package docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fp8rl.quant import kernels
from fp8rl.quant.formats import FP8Format, get_format
from fp8rl.quant.scaling import scale_from_amax

Granularity = Literal["tensor", "row", "block"]
GRANULARITIES: tuple[str, ...] = ("tensor", "row", "block")
# "auto": the fused Triton kernels for CUDA tensors on FP8-capable GPUs, the torch reference elsewhere;
# "torch": always the reference (the GPU tests compare the two); "triton": the kernels or an error.
QuantBackend = Literal["auto", "torch", "triton"]


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
    # x * (1 / s): the IEEE reciprocal of each scale (a tensor division, exact on CPU and CUDA alike), then one
    # multiply per value -- the arithmetic the fused kernels do (fp8rl.quant.kernels), so the bytes agree
    return (x * (scale.new_ones(()) / scale)).clamp_(-fmt.max, fmt.max).to(fmt.dtype)


def _check_dtype(x: torch.Tensor) -> None:
    if not x.dtype.is_floating_point or x.element_size() == 1:
        raise TypeError(f"can only quantize float16/bfloat16/float32/float64 tensors, got {x.dtype}")


def _require_float(x: torch.Tensor) -> torch.Tensor:
    _check_dtype(x)
    return x.to(torch.float32)


def _use_kernels(x: torch.Tensor, backend: QuantBackend, block: tuple[int, int] | None = None) -> bool:
    """Whether this call runs the fused kernels (``fp8rl.quant.kernels``) rather than the torch reference."""
    _check_dtype(x)
    fits = (
        kernels.kernels_available(x) and x.dtype != torch.float64 and (block is None or kernels.supports_block(block))
    )
    if backend == "triton" and not fits:
        raise ValueError(
            f"backend='triton' needs a float16/bfloat16/float32 CUDA tensor on an sm_89+ GPU with Triton and "
            f"power-of-two blocks up to 128 (got {x.dtype} on {x.device}, block {block})"
        )
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    return backend != "torch" and fits


def quantize_tensorwise(
    x: torch.Tensor,
    fmt: str | FP8Format = "e4m3",
    pow2: bool = False,
    *,
    backend: QuantBackend = "auto",
    check_finite: bool = True,
) -> QuantizedTensor:
    """One scale for the whole tensor; ``scale_inv`` has shape ``()``."""
    f = get_format(fmt)
    if _use_kernels(x, backend):
        q, scale, amax = kernels.quantize_tensor(x, f, pow2)
        if check_finite:
            _check_finite(amax, "quantize_tensorwise")
        return QuantizedTensor(q, scale, "tensor", f)
    xf = _require_float(x)
    amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
    if check_finite:
        _check_finite(amax, "quantize_tensorwise")
    scale = scale_from_amax(amax, f, pow2)
    return QuantizedTensor(_cast(xf, scale, f), scale, "tensor", f)


def quantize_rowwise(
    x: torch.Tensor,
    fmt: str | FP8Format = "e4m3",
    pow2: bool = False,
    *,
    backend: QuantBackend = "auto",
    check_finite: bool = True,
) -> QuantizedTensor:
    """One scale per row of the last dimension; ``scale_inv`` has shape ``[..., 1]``.

    For a weight ``[out, in]`` this is per output channel; for activations
    ``[tokens, in]`` it is per token.
    """
    f = get_format(fmt)
    if x.dim() >= 1 and _use_kernels(x, backend):
        q, scale = kernels.quantize_rows(x, f, pow2)
        if check_finite:
            _check_finite(scale, "quantize_rowwise")
        return QuantizedTensor(q, scale, "row", f)
    xf = _require_float(x)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    if check_finite:
        _check_finite(amax, "quantize_rowwise")
    scale = scale_from_amax(amax, f, pow2)
    return QuantizedTensor(_cast(xf, scale, f), scale, "row", f)


def quantize_blockwise(
    x: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    fmt: str | FP8Format = "e4m3",
    pow2: bool = False,
    *,
    backend: QuantBackend = "auto",
    check_finite: bool = True,
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
    if br != 1 and x.dim() != 2:
        raise ValueError(f"{br}x{bc} block quantization needs a 2-D tensor, got shape {tuple(x.shape)}")
    if x.dim() == 0:
        raise ValueError("block quantization needs at least one dimension")
    if _use_kernels(x, backend, block):
        if br == 1:
            q, scale, _, _ = kernels.quantize_groups(x.reshape(-1, x.shape[-1]), f, pow2, bc)
            assert q is not None and scale is not None
            q, scale = q.view(x.shape), scale.view(*x.shape[:-1], scale.shape[-1])
        else:
            q, scale, _, _ = kernels.quantize_tiles(x, f, pow2, block)
        if check_finite:
            _check_finite(scale, "quantize_blockwise")
        return QuantizedTensor(q, scale, "block", f, (br, bc))
    xf = _require_float(x)
    lead = xf.shape[:-1]
    cols = xf.shape[-1]
    x2 = xf.reshape(-1, cols)
    rows = x2.shape[0]
    n_r, n_c = math.ceil(rows / br), math.ceil(cols / bc)
    padded = F.pad(x2, (0, n_c * bc - cols, 0, n_r * br - rows))
    tiles = padded.view(n_r, br, n_c, bc)
    amax = tiles.abs().amax(dim=(1, 3))
    if check_finite:
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
    *,
    backend: QuantBackend = "auto",
    check_finite: bool = True,
) -> QuantizedTensor:
    """Quantize ``x`` at ``granularity`` (``block`` is used only for ``"block"``).

    ``backend="auto"`` runs the fused kernels on CUDA (same bytes as the reference, tested on the GPU).
    ``check_finite=False`` skips the NaN/Inf check, which costs a device synchronisation per call on
    CUDA; a non-finite input then gives a non-finite scale instead of an error (callers that quantize
    many tensors check the scales once, see ``check_scales_finite``).
    """
    if granularity == "tensor":
        return quantize_tensorwise(x, fmt, pow2, backend=backend, check_finite=check_finite)
    if granularity == "row":
        return quantize_rowwise(x, fmt, pow2, backend=backend, check_finite=check_finite)
    if granularity == "block":
        return quantize_blockwise(x, block, fmt, pow2, backend=backend, check_finite=check_finite)
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def quantize_weight(
    w: torch.Tensor, spec: QuantSpec, *, backend: QuantBackend = "auto", check_finite: bool = True
) -> QuantizedTensor:
    """Quantize a weight ``[out, in]`` per ``spec`` (128x128 tiles for ``block``)."""
    return quantize(
        w, spec.granularity, spec.fmt, spec.weight_block, spec.pow2_scales, backend=backend, check_finite=check_finite
    )


def quantize_activation(
    x: torch.Tensor, spec: QuantSpec, *, backend: QuantBackend = "auto", check_finite: bool = True
) -> QuantizedTensor:
    """Quantize activations or gradients ``[..., K]`` per ``spec`` (1 x act_block groups)."""
    return quantize(
        x, spec.granularity, spec.fmt, (1, spec.act_block), spec.pow2_scales, backend=backend, check_finite=check_finite
    )


def check_scales_finite(tensors: list[QuantizedTensor], what: str) -> None:
    """One NaN/Inf check (one device synchronisation) over many quantized tensors' scales."""
    if not tensors:
        return
    bad = torch.stack([(~torch.isfinite(q.scale_inv)).sum() for q in tensors])
    if bool(bad.any()):
        raise NonFiniteError(
            f"{what}: input holds NaN or Inf ({int(bad.sum())} scale group(s) affected); refusing to quantize"
        )


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
