"""The TransformerEngine trainer on a GPU: HF names, updates, BF16 agreement, FP8 bytes vs fp8rl.quant, checkpoints.

Skipped without a CUDA GPU or without TransformerEngine (see docs/te.md for the cuDNN
environment TE needs before Python starts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("pydantic")  # the trainer reads fp8rl.config (the bare GPU image has no pydantic)
from fp8rl.config import GRPOConfig, OptimConfig
from fp8rl.quant import QuantSpec, quantize_activation, quantize_weight
from fp8rl.rl import mismatch_metrics
from fp8rl.train.trainer import TorchTrainer, TrainerOptions, build_batch

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
te = pytest.importorskip("transformer_engine.pytorch")
if not te.is_fp8_block_scaling_available():
    pytest.skip("needs FP8 block scaling (compute capability 9.0+, CUDA 12.9+)", allow_module_level=True)

from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld  # noqa: E402
from fp8rl.train.te_recipes import te_recipe_for  # noqa: E402
from fp8rl.train.te_trainer import (  # noqa: E402
    TETrainer,
    build_te_recipe,
    quantization_agreement,
    te_block_quantizers,
    te_quantize_as_fp8rl,
)

PROMPTS = [[5, 6, 76, 7, 84], [8, 76, 9, 84], [5, 5, 76, 5, 5, 84]] * 4
RECIPES = {"block": ("block", "auto"), "current": ("tensor", "auto"), "delayed": ("tensor", "delayed")}


def _opts(precision: str, recipe: str = "block", backend: str = "te") -> TrainerOptions:
    gran, te_recipe = RECIPES[recipe]
    return TrainerOptions(
        precision=precision,
        spec=QuantSpec(granularity=gran),
        backend=backend,
        te_recipe=te_recipe,
        optim=OptimConfig(lr=1e-3, warmup_steps=0),
    )  # type: ignore[arg-type]


def _batch() -> tuple:
    gen = torch.Generator().manual_seed(0)
    resp = torch.randint(5, 90, (len(PROMPTS), 9), generator=gen)
    mask = torch.ones(len(PROMPTS), 9)
    mask[1, 6:] = 0
    return build_batch(PROMPTS, resp, mask, 0), mask


def test_state_dict_names_equal_the_torch_trainers(tiny_models: dict[str, Path]) -> None:
    t = TETrainer(tiny_models["small"], _opts("fp8"), device="cuda")
    ref = TorchTrainer(tiny_models["small"], _opts("fp8", backend="torch"), device="cuda")
    assert list(t.hf_state_dict()) == list(ref.hf_state_dict())
    assert t.fp8_modules == ref.fp8_modules
    assert all(isinstance(t.model.get_submodule(n), te.Linear) for n in t.fp8_modules)
    t.load_state_dict(ref.state_dict())


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_policy_step_moves_every_weight_with_a_finite_loss(tiny_models: dict[str, Path], recipe: str) -> None:
    t = TETrainer(tiny_models["tiny"], _opts("fp8", recipe), device="cuda")
    batch, mask = _batch()
    old = t.compute_logprobs(batch, 1.0)
    assert torch.isfinite(old).all() and (old[mask > 0] < 0).all()
    adv = torch.linspace(-1, 1, len(PROMPTS))
    if recipe == "delayed":
        # DelayedScaling quantizes with the amax history of earlier steps; the first step's scale of 1
        # flushes the small gradients of some weights to zero (seen on the H100), so it is warmed up once
        t.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0))
    before = {k: v.clone() for k, v in t.hf_state_dict().items()}
    m = t.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0))
    assert torch.isfinite(torch.tensor([m["loss"], m["grad_norm"]])).all()
    after = t.hf_state_dict()
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert set(moved) >= {n + ".weight" for n in t.fp8_modules}


def test_te_bf16_logprobs_match_torch_bf16(tiny_models: dict[str, Path]) -> None:
    batch, _ = _batch()
    a = TETrainer(tiny_models["tiny"], _opts("bf16"), device="cuda").compute_logprobs(batch, 1.0)
    b = TorchTrainer(tiny_models["tiny"], _opts("bf16", backend="torch"), device="cuda").compute_logprobs(batch, 1.0)
    torch.testing.assert_close(a, b, atol=2e-2, rtol=0)


def test_te_fp8_block_logprobs_close_to_torch_fp8(tiny_models: dict[str, Path]) -> None:
    batch, mask = _batch()
    a = TETrainer(tiny_models["small"], _opts("fp8"), device="cuda").compute_logprobs(batch, 1.0)
    b = TorchTrainer(tiny_models["small"], _opts("fp8", backend="torch"), device="cuda").compute_logprobs(batch, 1.0)
    assert mismatch_metrics(b, a, mask)["token_mult_prob_error"] < 1.02


@pytest.mark.parametrize("pow2", [False, True])
def test_block_quantizer_bytes_and_scales_match_fp8rl_quant(tiny_models: dict[str, Path], pow2: bool) -> None:
    spec = QuantSpec(pow2_scales=pow2)
    quantizers = te_block_quantizers(build_te_recipe(te_recipe_for(spec)))
    assert quantizers["weight"].force_pow_2_scales == pow2 and quantizers["weight"].block_scaling_dim == 2
    assert quantizers["input"].force_pow_2_scales == pow2 and quantizers["input"].block_scaling_dim == 1
    t = TETrainer(tiny_models["small"], _opts("fp8"), device="cuda")
    w = t.model.get_submodule(t.fp8_modules[0]).weight.detach()
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16) * torch.logspace(-3, 2, 256, device="cuda").to(
        torch.bfloat16
    )
    for ours, theirs in [
        (quantize_weight(w, spec), te_quantize_as_fp8rl(quantizers["weight"], w)),
        (quantize_activation(x, spec), te_quantize_as_fp8rl(quantizers["input"], x)),
    ]:
        agree = quantization_agreement(ours, theirs)
        if pow2:  # both round the scale up to a power of two: identical
            assert agree["bytes_exact_fraction"] == 1.0 and agree["scale_max_rel_diff"] == 0.0, agree
        else:  # 448/amax then 1/scale (TE) vs amax/448 (fp8rl): an ulp or two apart, ties may round apart
            assert agree["bytes_exact_fraction"] > 0.99 and agree["max_fp8_steps_apart"] <= 1, agree
            assert agree["scale_max_rel_diff"] < 3e-7, agree


def test_checkpoint_saves_and_loads_back(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from fp8rl.models.loading import load_causal_lm, load_tokenizer

    t = TETrainer(tiny_models["tiny"], _opts("fp8", "delayed"), device="cuda")
    batch, mask = _batch()
    t.policy_step(
        PolicyStep(
            batch,
            torch.ones(len(PROMPTS)),
            RecomputedOld(t.compute_logprobs(batch, 1.0), None, mask),
            GRPOConfig(),
            1.0,
        )
    )
    t.save_checkpoint(tmp_path / "ckpt", load_tokenizer(tiny_models["tiny"]))
    back = load_causal_lm(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert not any(k.endswith("_extra_state") for k in back.state_dict())
    for name, p in back.named_parameters():
        assert torch.equal(p, t.hf_state_dict()[name].cpu()), name
    again = TETrainer(tmp_path / "ckpt", _opts("fp8", "delayed"), device="cuda")
    again.load_state_dict(t.state_dict())
    assert again.step_count == 1
