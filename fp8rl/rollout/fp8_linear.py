"""The rollout engine's FP8 linear: FP8 weights + scales in memory, dynamic FP8 activations.

The weight is stored as ``float8_e4m3fn`` with its ``weight_scale_inv`` (the block-FP8
checkpoint layout), so weight memory really halves.  Each forward quantizes the input per
the recipe (1x128 groups for ``block``, per token for ``row``) and calls ``fp8_gemm``.
Weights are replaced in place (``load_``), never re-allocated.
"""

from __future__ import annotations

import torch
from torch import nn

from fp8rl.quant import QuantizedTensor, QuantSpec, fp8_gemm, get_format, quantize_activation, quantize_weight


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xq = quantize_activation(x.reshape(-1, self.in_features), self.spec)
        out = fp8_gemm(xq, self.quantized_weight(), out_dtype=x.dtype, bias=self.bias)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8={self.spec.granularity}"
