"""``optim.fp8_min_gemm_gflop``: an FP8 trainer keeps the decoder linears whose GEMM over a micro-batch is too small
to pay for FP8 in BF16, decided from the shapes alone (docs/benchmarks.md, "Where FP8 training pays")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8rl.config import OptimConfig, load_recipe, parse_run_config
from fp8rl.models.layers import drop_small_gemms, fp8_module_names
from fp8rl.models.shapes import SHAPES
from fp8rl.train.fp8_linear import FP8TrainLinear
from fp8rl.train.trainer import TorchTrainer, TrainerOptions


def _meta_llama(shape: str) -> torch.nn.Module:
    """The shape's model without memory (meta tensors): only the linears' widths are read."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
    )  # fmt: skip
    with torch.device("meta"):
        return LlamaForCausalLM(config)


@pytest.mark.parametrize(
    ("shape", "fp8_kinds"),
    [
        ("llama-8b", {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),  # K, V: 137 GFLOP < 500
        ("llama-3b", {"gate_proj", "up_proj", "down_proj"}),  # Q, O: 309 GFLOP < 500
        ("llama-1b", {"gate_proj", "up_proj", "down_proj"}),  # 550 GFLOP at 16,384 tokens
    ],
)
def test_at_16k_token_micro_batches_500_gflop_keeps_the_narrow_projections_in_bf16(
    shape: str, fp8_kinds: set[str]
) -> None:
    model = _meta_llama(shape)
    names = fp8_module_names(model)
    kept = drop_small_gemms(model, names, tokens=16384, min_gflop=500.0)
    assert {n.rsplit(".", 1)[1] for n in kept} == fp8_kinds
    assert len(kept) == SHAPES[shape].num_hidden_layers * len(fp8_kinds)
    assert drop_small_gemms(model, names, tokens=16384, min_gflop=0.0) == names  # 0: the recipe's, all of them
    assert drop_small_gemms(model, names, tokens=4096, min_gflop=500.0) == []  # 4,096-token micro-batches: none


def test_the_trainer_swaps_only_the_linears_that_pay(tiny_models: dict[str, Path]) -> None:
    """tiny (hidden 128, MLP 384): at 4,096 tokens q/k/v/o are 0.134 GFLOP, gate/up/down 0.403."""
    optim = OptimConfig(micro_batch_tokens=4096, fp8_min_gemm_gflop=0.2)
    opts = TrainerOptions(precision="fp8", spec=load_recipe("fp8-e2e").quant.spec(), optim=optim)
    trainer = TorchTrainer(tiny_models["tiny"], opts)
    assert trainer.fp8_modules and all(n.split(".")[-2] == "mlp" for n in trainer.fp8_modules)
    swapped = {n for n, m in trainer.model.named_modules() if isinstance(m, FP8TrainLinear)}
    assert swapped == set(trainer.fp8_modules) and len(swapped) == 2 * 3  # 2 layers x gate, up, down
    attn = trainer.model.get_submodule("model.layers.0.self_attn.q_proj")
    assert type(attn) is torch.nn.Linear


def test_the_setting_needs_token_micro_batches() -> None:
    with pytest.raises(Exception, match="optim.fp8_min_gemm_gflop compares .* set optim.micro_batch_tokens"):
        parse_run_config({"recipe": load_recipe("fp8-e2e"), "optim": {"fp8_min_gemm_gflop": 500}}, "test")
