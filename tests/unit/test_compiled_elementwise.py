"""``optim.compile_elementwise``: the decoder's RMSNorm, SiLU gate and rotary embedding as torch.compile kernels.

Runs torch.compile for real (Inductor's CPU backend here; Triton on a GPU): the hand-written backward is
autograd's own in float32, the patched model computes the same logits and gradients as HF's eager modules up
to rounding (also with activation checkpointing, whose recompute must save what the forward saved), the names
and parameters are unchanged, and a model with none of the known modules is refused with the option's name.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from fp8rl.train.compiled import ATTENTION_CLASSES, _RMSNorm, _SiluMul, apply_rotary_pos_emb, compile_elementwise


def _model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32)  # fmt: skip
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def test_compiled_parts_match_the_eager_model() -> None:
    eager, fused = _model(0), _model(0)
    for p in fused.model.norm.parameters():
        assert p.dtype == torch.bfloat16
    names = compile_elementwise(fused)
    assert sorted(names) == sorted(
        ["model.norm"]
        + [f"model.layers.{i}.{n}" for i in range(2)
           for n in ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")]
    )  # fmt: skip
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in eager.named_parameters()]
    ids = torch.randint(0, 96, (3, 17))
    for _ in range(2):  # a second call reuses the compiled kernels (and a new shape compiles again, dynamic)
        outs = []
        for model in (eager, fused):
            model.zero_grad()
            logits = model(input_ids=ids).logits.float()
            logits.logsumexp(-1).mean().backward()
            outs.append((logits.detach(), [p.grad.float() for p in model.parameters()]))
        (le, ge), (lf, gf) = outs
        assert ((lf - le).norm() / le.norm()).item() < 2e-2
        for a, b in zip(gf, ge, strict=True):
            assert ((a - b).norm() / b.norm().clamp(min=1e-6)).item() < 5e-2
        ids = torch.randint(0, 96, (2, 9))


def test_the_compiled_backward_is_autograds_in_float32() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    g, u = torch.randn(4, 96, dtype=torch.float64), torch.randn(4, 96, dtype=torch.float64)
    dy_norm, dy_gate = torch.randn(3, 5, 64, dtype=torch.float64), torch.randn(4, 96, dtype=torch.float64)

    def eager_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    cases = [
        (lambda a, b: _RMSNorm.apply(a, b, 1e-6), eager_norm, (x, w), dy_norm),
        (_SiluMul.apply, lambda a, b: nn.functional.silu(a) * b, (g, u), dy_gate),
    ]
    for fused, eager, inputs, dy in cases:
        grads = []
        for fn in (fused, eager):
            leaves = [t.to(torch.float32).requires_grad_(True) for t in inputs]
            out = fn(*leaves)
            out.backward(dy.to(torch.float32))
            grads.append((out.detach(), [t.grad for t in leaves]))
        (of, gf), (oe, ge) = grads
        torch.testing.assert_close(of, oe, rtol=1e-5, atol=1e-5)
        for a, b in zip(gf, ge, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_fused_rotary_embedding_is_hfs_with_its_gradients(arch: str) -> None:
    """Against each allow-listed architecture's own ``apply_rotary_pos_emb`` in float32 (the math; bf16 differs by
    rounding only): q and k laid out as HF's attention makes them (a transposed view of the projection), the
    outputs and both input gradients; cos and sin needing gradients take the eager path and get theirs."""
    hf = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}").apply_rotary_pos_emb
    assert f"{arch.capitalize() if arch != 'qwen2' else 'Qwen2'}Attention".lower() in {
        c.lower() for c in ATTENTION_CLASSES
    }
    torch.manual_seed(0)
    b, t, hq, hk, d = 2, 7, 4, 2, 16
    q0 = torch.randn(b, t, hq, d).transpose(1, 2)
    k0 = torch.randn(b, t, hk, d).transpose(1, 2)
    angles = torch.randn(b, t, d // 2).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    dq, dk = torch.randn(b, hq, t, d), torch.randn(b, hk, t, d)
    got = []
    for fn in (apply_rotary_pos_emb, hf):
        q, k = q0.clone().requires_grad_(True), k0.clone().requires_grad_(True)
        qe, ke = fn(q, k, cos, sin)
        torch.autograd.backward((qe, ke), (dq, dk))
        got.append((qe.detach(), ke.detach(), q.grad, k.grad))
    for a, b_ in zip(*got, strict=True):
        torch.testing.assert_close(a, b_, rtol=1e-6, atol=1e-6)
    # cos and sin with gradients: the eager path, whose gradients reach them
    c, s_ = cos.clone().requires_grad_(True), sin.clone().requires_grad_(True)
    qe, ke = apply_rotary_pos_emb(q0, k0, c, s_)
    (qe.sum() + ke.sum()).backward()
    assert c.grad is not None and s_.grad is not None and c.grad.abs().sum() > 0


def test_patching_one_model_changes_no_other() -> None:
    """The fused rotary embedding is bound in the patched attentions' own copy of the forward's globals: HF's
    module keeps its function, and an unpatched model in the same process runs HF's forward."""
    import transformers.models.llama.modeling_llama as modeling

    before = modeling.apply_rotary_pos_emb
    eager, fused = _model(2), _model(2)
    compile_elementwise(fused)
    assert modeling.apply_rotary_pos_emb is before
    assert "forward" not in vars(eager.model.layers[0].self_attn)
    patched = fused.model.layers[0].self_attn.forward
    assert patched.__func__.__globals__["apply_rotary_pos_emb"] is apply_rotary_pos_emb
    assert patched.__func__.__code__ is type(eager.model.layers[0].self_attn).forward.__code__


def test_an_allow_listed_attention_that_moved_is_refused_loudly() -> None:
    """An allow-listed attention class whose forward no longer calls ``apply_rotary_pos_emb`` (or calls one of
    another signature) is an error naming the class, not a silently unfused model."""
    model = _model(3)
    attention = model.model.layers[0].self_attn

    def moved(self: nn.Module, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return hidden_states

    moved_cls = type("LlamaAttention", (nn.Module,), {"forward": moved})
    attention.__class__ = moved_cls
    with pytest.raises(RuntimeError, match=r"LlamaAttention.forward no longer calls apply_rotary_pos_emb"):
        compile_elementwise(model)
    assert not [m for m in model.modules() if "forward" in vars(m)]  # refused before anything was patched

    def other_signature(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> object:
        return q, k

    def calls_it(self: nn.Module, hidden_states: torch.Tensor) -> object:
        return apply_rotary_pos_emb(hidden_states, hidden_states, hidden_states, hidden_states)

    scope = {"apply_rotary_pos_emb": other_signature}
    forward = types.FunctionType(calls_it.__code__, scope, "forward")
    attention.__class__ = type("LlamaAttention", (nn.Module,), {"forward": forward})
    with pytest.raises(RuntimeError, match=r"takes \['q', 'k', 'cos', 'sin'\], not"):
        compile_elementwise(model)


def test_compiled_parts_under_activation_checkpointing_match_the_eager_model() -> None:
    eager, fused = _model(1), _model(1)
    compile_elementwise(fused)
    for model in (eager, fused):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    ids = torch.randint(0, 96, (2, 13))
    outs = []
    for model in (eager, fused):
        loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()  # the recompute's saved tensors are checked against the forward's (metadata must agree)
        outs.append((loss.detach(), [p.grad.float() for p in model.parameters()]))
    (le, ge), (lf, gf) = outs
    assert abs((lf - le).item()) < 2e-2 * abs(le.item())
    for a, b in zip(gf, ge, strict=True):
        assert ((a - b).norm() / b.norm().clamp(min=1e-6)).item() < 5e-2


def test_a_model_without_known_modules_is_refused_by_the_option_name() -> None:
    with pytest.raises(ValueError, match=r"optim\.compile_elementwise: Sequential has no RMSNorm, SiLU MLP or rotary"):
        compile_elementwise(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
