"""The torch-native FP8 linear for training: forward, dgrad and wgrad GEMMs all in FP8.

Per the block recipe (DeepSeek-V3, TransformerEngine ``Float8BlockScaling``), every GEMM
quantizes each operand along its own reduction dimension:

    forward  Y[M,N]  = X[M,K]  @ W[N,K]^T   X: 1x128 groups along K, W: 128x128 tiles
    dgrad    dX[M,K] = dY[M,N] @ W^T[K,N]^T dY: 1x128 along N,       W^T: 128x128 tiles
    wgrad    dW[N,K] = dY^T[N,M] @ X^T[K,M]^T  dY^T and X^T: 1x128 along M (tokens)

All of it goes through ``fp8rl.quant`` (``fp8_gemm``: tensor cores on Hopper, exact
emulation on CPU), so a weight quantizes to the same bytes here as in the rollout engine
and in the converted checkpoint.  The module holds the weight in the model's dtype
(bf16); master weights live in the optimizer (``fp8rl.train.optim``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fp8rl.quant import QuantSpec, fp8_gemm, quantize_activation, quantize_weight


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: QuantSpec
    ) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        out = fp8_gemm(quantize_activation(x2, spec), quantize_weight(weight, spec), out_dtype=x.dtype, bias=bias)
        ctx.save_for_backward(x2, weight)
        ctx.spec = spec
        ctx.has_bias = bias is not None
        return out.reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        spec: QuantSpec = ctx.spec
        g2 = grad_out.reshape(-1, weight.shape[0])
        grad_x = fp8_gemm(
            quantize_activation(g2, spec), quantize_weight(weight.t(), spec), out_dtype=grad_out.dtype
        ).reshape(*grad_out.shape[:-1], weight.shape[1])
        grad_w = fp8_gemm(
            quantize_activation(g2.t(), spec), quantize_activation(x2.t(), spec), out_dtype=torch.float32
        ).to(weight.dtype)
        grad_b = g2.sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class FP8TrainLinear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run in FP8 per ``spec``; parameters unchanged (same names)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, spec: QuantSpec, **kw: Any) -> None:
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.spec = spec

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: QuantSpec) -> FP8TrainLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias  # share the Parameters
        new.spec = spec
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FP8LinearFunction.apply(x.to(self.weight.dtype), self.weight, self.bias, self.spec)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.spec.granularity}"
