"""The rollout engine's FP8 linear: FP8 weights + scales in memory, dynamic FP8 activations.

The weight is stored as ``float8_e4m3fn`` with its ``weight_scale_inv`` (the block-FP8
checkpoint layout), so weight memory really halves.  Each forward quantizes the input per
the recipe (1x128 groups for ``block``, per token for ``row``) and calls ``fp8_gemm``.
Weights are replaced in place (``load_``), never re-allocated.  On Hopper with the block recipe the
forward is the fused path of ``fp8rl.quant.block_linear`` (one Triton pass quantizes the input, a
cuBLAS block GEMM reads the weight's scales from a copy kept in cuBLAS's layout, refreshed on load).
Where the GEMM is emulated on the CPU (no FP8 tensor cores), the dequantized FP32 weight is kept beside the FP8
one and re-made when the weight is written: a generation then converts each weight from FP8 once, not at every
token (the same numbers; on the CPU the copy's memory is not what FP8 saves on a GPU).
"""

from __future__ import annotations

import torch
from torch import nn

from fp8rl.quant import (
    QuantizedTensor,
    QuantSpec,
    dequantize,
    fp8_gemm,
    get_format,
    quantize_activation,
    quantize_weight,
)
from fp8rl.quant.block_linear import block_linear_supported, block_mm, quantize_block_input
from fp8rl.quant.gemm import fp8_gemm_backend, tile_scales_for_cublas


class FP8InferenceLinear(nn.Module):
    weight: torch.Tensor
    weight_scale_inv: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, spec: QuantSpec) -> None:
        super().__init__()
        self.spec = spec
        self.out_features, self.in_features = weight.shape
        q = quantize_weight(weight, spec)
        self.register_buffer("weight", q.data)
        self.register_buffer("weight_scale_inv", q.scale_inv)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._block = q.block
        self._scale_cublas: torch.Tensor | None = None
        self._scale_key: tuple[int, int] | None = None
        self._dense: torch.Tensor | None = None
        self._dense_key: tuple[int, int, int, int] | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: QuantSpec) -> FP8InferenceLinear:
        return cls(linear.weight.detach(), linear.bias, spec)

    def quantized_weight(self) -> QuantizedTensor:
        return QuantizedTensor(
            self.weight, self.weight_scale_inv, self.spec.granularity, get_format(self.spec.fmt), self._block
        )

    @torch.no_grad()
    def load_(self, weight: torch.Tensor | None = None, q: QuantizedTensor | None = None) -> None:
        """Overwrite the weight in place: from a high-precision ``weight`` (quantized here) or a pre-quantized ``q``."""
        if q is None:
            if weight is None:
                raise ValueError("load_ needs a weight or a quantized weight")
            q = quantize_weight(weight.to(self.weight.device), self.spec)
        if q.data.shape != self.weight.shape or q.scale_inv.shape != self.weight_scale_inv.shape:
            raise ValueError(
                f"shape mismatch: got {tuple(q.data.shape)}/{tuple(q.scale_inv.shape)}, "
                f"engine holds {tuple(self.weight.shape)}/{tuple(self.weight_scale_inv.shape)}"
            )
        self.weight.copy_(q.data)
        self.weight_scale_inv.copy_(q.scale_inv)

    def _fused_weight_scale(self) -> torch.Tensor | None:
        """The weight's tile scales in cuBLAS's layout when the fused path applies, re-made whenever
        ``weight_scale_inv`` was written (its version counter: ``load_`` or any other in-place writer)."""
        if not block_linear_supported(self.in_features, self.out_features, self.spec, self.weight.device):
            return None
        key = (self.weight_scale_inv.data_ptr(), self.weight_scale_inv._version)
        if self._scale_cublas is None or self._scale_key != key:
            self._scale_cublas = tile_scales_for_cublas(self.weight_scale_inv)
            self._scale_key = key
        return self._scale_cublas

    def _dequantized_weight(self) -> torch.Tensor | None:
        """The FP32 weight for the CPU's emulated GEMM, re-made whenever ``weight`` or ``weight_scale_inv`` was
        written (their version counters); None off the CPU."""
        if self.weight.device.type != "cpu":
            return None
        key = (self.weight.data_ptr(), self.weight._version, self.weight_scale_inv.data_ptr(),
               self.weight_scale_inv._version)  # fmt: skip
        if self._dense is None or self._dense_key != key:
            self._dense = dequantize(self.quantized_weight())
            self._dense_key = key
        return self._dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        w_scale = self._fused_weight_scale()
        if w_scale is not None:
            x2 = x.reshape(-1, self.in_features)
            xb, xs, _, _ = quantize_block_input(x2, self.spec, rowwise=True, colwise=False)
            assert xb is not None and xs is not None
            out = block_mm(xb, xs, self.weight, w_scale, x2.shape[0])
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
            return out.to(x.dtype).reshape(*lead, self.out_features)
        xq = quantize_activation(x.reshape(-1, self.in_features), self.spec)
        wq = self.quantized_weight()
        dense = self._dequantized_weight() if fp8_gemm_backend(xq, wq) == "emulated" else None
        out = fp8_gemm(xq, wq, out_dtype=x.dtype, bias=self.bias, w_dequantized=dense)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8={self.spec.granularity}"
