"""Compiled elementwise parts of the decoder (``optim.compile_elementwise``): RMSNorm, the SiLU gate, the rotary embedding.

Once the FP8 GEMMs are fast, a decoder layer's step is bounded by what is not a GEMM: HF's RMSNorm is
five kernels forward (upcast, square-mean, rsqrt-multiply, downcast, weight multiply) and more backward,
and the MLP's ``silu(gate) * up`` two passes over the widest activation; on an H100 these "other" kernels
were ~64 ms of a ~200 ms step of four Llama-3-8B-width layers in either precision (docs/benchmarks.md).
Here each becomes a ``torch.autograd.Function`` whose forward and backward are ``torch.compile``d
(Inductor/Triton) functions without autograd of their own, one kernel or a few each way, for BF16 and FP8
alike: the same math, fused, so results differ from eager only by rounding (Inductor keeps the
intermediate in float32 where eager rounds the SiLU output to bf16).  The Function saves what it names
(the input, the weight and the fp32 reciprocal RMS; the gate and up projections) and nothing else, so a
layer under activation checkpointing saves the same tensors in its recompute as in its forward: the
earlier version compiled the forward with autograd inside and, on two H200s, its recompute fell back to
eager modules that saved other tensors, and ``torch.utils.checkpoint`` stopped the backward.

The rotary embedding: HF applies it to q and k as ten eager kernels a layer (``q * cos + rotate_half(q) * sin``,
``rotate_half`` a negation and a concatenation), each a pass over q or k, and as many again in the backward and in
a checkpointed layer's recompute: ~1.6 s of the 8B step's train phase on two H200s, the largest "other" part
(docs/benchmarks.md, history, 2026-11-26).  Fused, it is one pass each way; the Function saves only ``cos`` and
``sin`` (the backward is linear in the output gradient).  HF's attention forward calls the module-level
``apply_rotary_pos_emb``; a patched attention runs HF's own forward code with that one name bound to the fused
function (a copy of the function over its module's globals), so nothing else in the process changes; an
allow-listed attention whose forward no longer calls it, or calls one of another signature, is refused before
anything is patched (transformers moved the target: this module must follow).

Only modules whose forward is known to be exactly this math are patched (an allow-list of HF classes:
Llama, Qwen2/3, Mistral), each by an instance-level ``forward`` that calls one shared compiled function,
so Dynamo compiles once per shape class rather than once per module.  Names and parameters are unchanged.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import nn

NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
MLP_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"})
ATTENTION_CLASSES = frozenset({"LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention"})
ROTARY_NAME = "apply_rotary_pos_emb"  # what those classes' forward calls, from its module's globals
ROTARY_PARAMETERS = ["q", "k", "cos", "sin", "unsqueeze_dim"]  # its signature, which the fused one takes


def _rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``LlamaRMSNorm.forward``, op for op; also the fp32 reciprocal RMS the backward reads."""
    h = x.to(torch.float32)
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (h * rstd).to(x.dtype), rstd


def _rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients autograd takes through ``_rms_norm_fwd``: the normalized input rounded as the forward
    rounds it, the weight's gradient summed over every row in fp32."""
    h = x.to(torch.float32)
    n = (h * rstd).to(x.dtype)
    dn = (dy * weight).to(torch.float32)
    dw = (dy.to(torch.float32) * n.to(torch.float32)).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
    dx = rstd * dn - h * rstd.pow(3) * (dn * h).mean(-1, keepdim=True)
    return dx.to(x.dtype), dw


def _silu_mul_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return nn.functional.silu(gate) * up


def _silu_mul_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, u, d = gate.to(torch.float32), up.to(torch.float32), dy.to(torch.float32)
    s = torch.sigmoid(g)
    dgate = d * u * s * (1.0 + g * (1.0 - s))
    return dgate.to(gate.dtype), (d * g * s).to(up.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rotate_half_t(z: torch.Tensor) -> torch.Tensor:
    """The transpose of ``_rotate_half`` (a signed permutation): where it put ``-x2, x1``, this puts ``z2, -z1``."""
    h = z.shape[-1] // 2
    return torch.cat((z[..., h:], -z[..., :h]), dim=-1)


def _rope_fwd(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``apply_rotary_pos_emb`` after its unsqueeze (``cos``/``sin`` broadcast against q and k)."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rope_bwd(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return dq * cos + _rotate_half_t(dq * sin), dk * cos + _rotate_half_t(dk * sin)


@cache
def _compiled(name: str) -> Any:
    fns: dict[str, Callable[..., Any]] = {
        "rms_norm_fwd": _rms_norm_fwd,
        "rms_norm_bwd": _rms_norm_bwd,
        "silu_mul_fwd": _silu_mul_fwd,
        "silu_mul_bwd": _silu_mul_bwd,
        "rope_fwd": _rope_fwd,
        "rope_bwd": _rope_bwd,
    }
    return torch.compile(fns[name], dynamic=None)


class _RMSNorm(torch.autograd.Function):
    """Compiled forward and backward with the saved tensors named here (input, weight, fp32 reciprocal RMS):
    what a checkpointed layer's recompute saves is then the same whether Dynamo compiles or falls back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = _compiled("rms_norm_fwd")(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _compiled("rms_norm_bwd")(dy.contiguous(), x, weight, rstd)
        return dx, dw, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _compiled("silu_mul_fwd")(gate, up)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return _compiled("silu_mul_bwd")(dy.contiguous(), gate, up)


class _Rotary(torch.autograd.Function):
    """q and k rotated in one compiled pass each way; saves ``cos`` and ``sin`` only (no gradient for them)."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        return _compiled("rope_fwd")(q, k, cos, sin)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        gq, gk = _compiled("rope_bwd")(dq, dk, cos, sin)
        return gq, gk, None, None


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``apply_rotary_pos_emb`` (same signature and math), fused; eager where ``cos``/``sin`` need gradients
    (HF computes them without: the fused backward gives none)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    if cos.requires_grad or sin.requires_grad:
        return _rope_fwd(q, k, cos, sin)
    return _Rotary.apply(q, k, cos, sin)


@cache
def _forward_with_fused_rotary(forward: types.FunctionType) -> types.FunctionType:
    """``forward``'s own code over a copy of its globals in which ``apply_rotary_pos_emb`` is the fused one."""
    scope = dict(forward.__globals__)
    scope[ROTARY_NAME] = apply_rotary_pos_emb
    fn = types.FunctionType(forward.__code__, scope, forward.__name__, forward.__defaults__, forward.__closure__)
    fn.__kwdefaults__ = forward.__kwdefaults__
    fn.__qualname__ = forward.__qualname__
    return fn


def _is_rotary_attention(m: nn.Module) -> bool:
    """An allow-listed attention class whose forward calls its module's ``apply_rotary_pos_emb`` with HF's
    signature; an allow-listed class that no longer does raises (transformers moved what this binds)."""
    if type(m).__name__ not in ATTENTION_CLASSES:
        return False
    forward, cls = type(m).forward, type(m).__qualname__
    hf = getattr(forward, "__globals__", {}).get(ROTARY_NAME)
    if not (isinstance(forward, types.FunctionType) and ROTARY_NAME in forward.__code__.co_names and callable(hf)):
        raise RuntimeError(
            f"optim.compile_elementwise: {cls}.forward no longer calls {ROTARY_NAME} from its module (transformers "
            "changed it); fp8rl.train.compiled must be updated to fuse its rotary embedding"
        )
    takes = list(inspect.signature(hf).parameters)
    if takes != ROTARY_PARAMETERS:
        raise RuntimeError(
            f"optim.compile_elementwise: {cls}'s {ROTARY_NAME} takes {takes}, "
            f"not {ROTARY_PARAMETERS} (transformers changed it); fp8rl.train.compiled must be updated"
        )
    return True


def _norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return _RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    down: Any = self.down_proj
    gate: Any = self.gate_proj
    up: Any = self.up_proj
    return down(_SiluMul.apply(gate(x), up(x)))


SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})  # torch's and transformers' (ACT2FN["silu"])


def _is_silu_mlp(m: nn.Module) -> bool:
    return (
        type(m).__name__ in MLP_CLASSES
        and type(getattr(m, "act_fn", None)).__name__ in SILU_CLASSES
        and all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))
    )


def compile_elementwise(model: nn.Module) -> list[str]:
    """Patch ``model``'s RMSNorms, SiLU MLPs and attentions' rotary embedding to the compiled kernels; returns the
    patched module names.

    Raises ``ValueError`` when the model has none of them (an architecture this does not know), so that
    asking for it never silently does nothing.
    """
    forwards: list[tuple[str, nn.Module, Callable[..., Any]]] = []  # decided for every module before any changes
    for name, m in model.named_modules():
        if type(m).__name__ in NORM_CLASSES and hasattr(m, "variance_epsilon"):
            forwards.append((name, m, _norm_forward))
        elif _is_silu_mlp(m):
            forwards.append((name, m, _mlp_forward))
        elif _is_rotary_attention(m):  # raises, before anything is patched, where transformers moved the target
            forwards.append((name, m, _forward_with_fused_rotary(type(m).forward)))
    for _, m, forward in forwards:
        m.forward = types.MethodType(forward, m)
    patched = [name for name, _, _ in forwards]
    if not patched:
        raise ValueError(
            f"optim.compile_elementwise: {type(model).__name__} has no RMSNorm, SiLU MLP or rotary attention of a "
            f"known class ({', '.join(sorted(NORM_CLASSES | MLP_CLASSES | ATTENTION_CLASSES))}); turn it off for "
            "this model"
        )
    return patched
