"""Compiled elementwise parts of the decoder (``optim.compile_elementwise``): RMSNorm and the SiLU gate.

Once the FP8 GEMMs are fast, a decoder layer's step is bounded by what is not a GEMM: HF's RMSNorm is
five kernels forward (upcast, square-mean, rsqrt-multiply, downcast, weight multiply) and more backward,
and the MLP's ``silu(gate) * up`` two passes over the widest activation; on an H100 these "other" kernels
were ~64 ms of a ~200 ms step of four Llama-3-8B-width layers in either precision (docs/benchmarks.md).
Here each becomes one ``torch.compile`` (Inductor/Triton) kernel forward and few backward, for BF16 and FP8
alike: the same math, fused, so results differ from eager only by rounding (Inductor keeps the
intermediate in float32 where eager rounds the SiLU output to bf16).

Only modules whose forward is known to be exactly this math are patched (an allow-list of HF classes:
Llama, Qwen2/3, Mistral), each by an instance-level ``forward`` that calls one shared compiled function,
so Dynamo compiles once per shape class rather than once per module.  Names and parameters are unchanged.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import nn

NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
MLP_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"})


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``LlamaRMSNorm.forward``, op for op."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return nn.functional.silu(gate) * up


@cache
def _compiled(name: str) -> Any:
    fns: dict[str, Callable[..., torch.Tensor]] = {"rms_norm": _rms_norm, "silu_mul": _silu_mul}
    return torch.compile(fns[name], dynamic=None)


def _norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return _compiled("rms_norm")(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    down: Any = self.down_proj
    gate: Any = self.gate_proj
    up: Any = self.up_proj
    return down(_compiled("silu_mul")(gate(x), up(x)))


SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})  # torch's and transformers' (ACT2FN["silu"])


def _is_silu_mlp(m: nn.Module) -> bool:
    return (
        type(m).__name__ in MLP_CLASSES
        and type(getattr(m, "act_fn", None)).__name__ in SILU_CLASSES
        and all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))
    )


def compile_elementwise(model: nn.Module) -> list[str]:
    """Patch ``model``'s RMSNorms and SiLU MLPs to the compiled kernels; returns the patched module names.

    Raises ``ValueError`` when the model has none of them (an architecture this does not know), so that
    asking for it never silently does nothing.
    """
    patched = []
    for name, m in model.named_modules():
        if type(m).__name__ in NORM_CLASSES and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(_norm_forward, m)
            patched.append(name)
        elif _is_silu_mlp(m):
            m.forward = types.MethodType(_mlp_forward, m)
            patched.append(name)
    if not patched:
        raise ValueError(
            f"optim.compile_elementwise: {type(model).__name__} has no RMSNorm or SiLU MLP of a known class "
            f"({', '.join(sorted(NORM_CLASSES | MLP_CLASSES))}); turn it off for this model"
        )
    return patched
