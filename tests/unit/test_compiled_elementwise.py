"""``optim.compile_elementwise``: the decoder's RMSNorm and SiLU gate as torch.compile kernels.

Runs torch.compile for real (Inductor's CPU backend here; Triton on a GPU): the patched model computes the
same logits and gradients as HF's eager modules up to rounding, the names and parameters are unchanged, and
a model with none of the known modules is refused with the option's name.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from fp8rl.train.compiled import compile_elementwise


def _model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32)  # fmt: skip
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def test_compiled_norms_and_gate_match_the_eager_model() -> None:
    eager, fused = _model(0), _model(0)
    for p in fused.model.norm.parameters():
        assert p.dtype == torch.bfloat16
    names = compile_elementwise(fused)
    assert sorted(names) == sorted(
        ["model.norm"]
        + [f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm", "mlp")]
    )
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


def test_a_model_without_known_modules_is_refused_by_the_option_name() -> None:
    with pytest.raises(ValueError, match=r"optim\.compile_elementwise: Sequential has no RMSNorm"):
        compile_elementwise(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
