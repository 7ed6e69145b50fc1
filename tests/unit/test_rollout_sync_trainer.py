"""The torch rollout engine, the FP8 training linear, the trainer and the requantized weight sync."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fp8rl.config import GRPOConfig, OptimConfig
from fp8rl.quant import QuantizedTensor, QuantSpec, quantize_activation, quantize_weight
from fp8rl.rollout import FP8InferenceLinear, SamplingParams, TorchRolloutEngine, filter_logits
from fp8rl.sync import InProcessSync, SyncVerificationError, verify_engine_weights
from fp8rl.train.fp8_linear import FP8TrainLinear
from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld
from fp8rl.train.trainer import TorchTrainer, TrainerOptions, build_batch

PROMPTS = [[5, 6, 76, 7, 84], [8, 76, 9, 84], [5, 5, 76, 5, 5, 84]]


def test_fp8_train_linear_quantizes_all_three_gemms() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(256, 384, bias=False).to(torch.bfloat16)
    spec = QuantSpec()
    f = FP8TrainLinear.from_linear(lin, spec)
    x = torch.randn(6, 256, dtype=torch.bfloat16, requires_grad=True)
    f(x).float().sum().backward()
    g = torch.ones(6, 384, dtype=torch.bfloat16)
    # independent reference: dequantized operands, float64 GEMMs
    xq, wq = quantize_activation(x.detach(), spec), quantize_weight(lin.weight.detach(), spec)
    fwd = xq.dequantize(torch.float64) @ wq.dequantize(torch.float64).t()
    torch.testing.assert_close(f(x.detach()).double(), fwd, rtol=1e-2, atol=1e-2)
    dx = (
        quantize_activation(g, spec).dequantize(torch.float64)
        @ quantize_weight(lin.weight.detach().t(), spec).dequantize(torch.float64).t()
    )
    torch.testing.assert_close(x.grad.double(), dx, rtol=1e-2, atol=1e-2)
    dw = (
        quantize_activation(g.t(), spec).dequantize(torch.float64)
        @ quantize_activation(x.detach().t(), spec).dequantize(torch.float64).t()
    )
    torch.testing.assert_close(lin.weight.grad.double(), dw, rtol=1e-2, atol=1e-2)


def test_inference_linear_stores_fp8_and_matches_training_forward() -> None:
    lin = nn.Linear(256, 128, bias=True).to(torch.bfloat16)
    inf = FP8InferenceLinear.from_linear(lin, QuantSpec())
    assert inf.weight.dtype == torch.float8_e4m3fn and inf.weight_scale_inv.shape == (1, 2)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    assert torch.equal(inf(x), FP8TrainLinear.from_linear(lin, QuantSpec())(x))
    ptr = inf.weight.data_ptr()
    inf.load_(weight=torch.zeros(128, 256))
    assert inf.weight.data_ptr() == ptr and float(inf.weight.float().abs().sum()) == 0


@pytest.mark.parametrize("granularity", ["block", "row"])
def test_the_cpu_forward_keeps_the_dequantized_weight_until_the_weight_is_written(granularity: str) -> None:
    """On the CPU the FP32 weight is dequantized once and kept: the forward is the uncached GEMM's to the bit, and
    every write of the weight (a sync's ``load_``, a scale written alone, any in-place copy) makes it again."""
    from fp8rl.quant import dequantize, fp8_gemm

    spec = QuantSpec(granularity=granularity)
    inf = FP8InferenceLinear.from_linear(nn.Linear(256, 128, bias=False).to(torch.bfloat16), spec)
    x = torch.randn(3, 256, dtype=torch.bfloat16)

    def uncached() -> torch.Tensor:
        return fp8_gemm(quantize_activation(x, spec), inf.quantized_weight(), out_dtype=x.dtype)

    first = inf(x)
    assert torch.equal(first, uncached())
    kept = inf._dense
    assert kept is not None and torch.equal(kept, dequantize(inf.quantized_weight()))
    assert torch.equal(inf(x), first) and inf._dense is kept  # no weight write: the same tensor, not re-made
    inf.load_(weight=torch.randn(128, 256))  # a sync
    assert torch.equal(inf(x), uncached()) and not torch.equal(inf(x), first)
    inf.weight_scale_inv.mul_(2)  # the scales alone
    assert torch.equal(inf(x), uncached())
    inf.weight.copy_(torch.zeros(128, 256).to(inf.weight.dtype))  # any in-place writer
    assert float(inf(x).abs().sum()) == 0


def test_filter_logits_top_k_top_p() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    assert torch.isinf(filter_logits(logits, 2, 1.0)[0, 2:]).all()
    p = logits.softmax(-1)[0]
    kept = filter_logits(logits, 0, float(p[0] + 0.01))
    assert torch.isfinite(kept[0, :2]).all() and torch.isinf(kept[0, 2:]).all()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_engine_generates_with_own_logprobs(tiny_models: dict[str, Path], precision: str) -> None:
    engine = TorchRolloutEngine(tiny_models["tiny"], precision)
    r = engine.generate(PROMPTS * 4, SamplingParams(max_tokens=5, seed=3))
    assert r.response_ids.shape[0] == 12 and r.response_ids.shape[1] <= 5
    assert (r.logprobs <= 0).all() and (r.logprobs[r.response_mask == 0] == 0).all()
    again = engine.generate(PROMPTS * 4, SamplingParams(max_tokens=5, seed=3))
    assert torch.equal(r.response_ids, again.response_ids)  # seeded
    # logprobs come from the engine's forward: the trainer's full-sequence recompute under the
    # same numerics (bf16 engine vs bf16 trainer) agrees to float rounding
    if precision == "bf16":
        trainer = TorchTrainer(tiny_models["tiny"], TrainerOptions(optim=OptimConfig(lr=2e-5, warmup_steps=0)))
        lp = trainer.compute_logprobs(build_batch(r.prompt_ids, r.response_ids, r.response_mask, 0), 1.0)
        torch.testing.assert_close(lp, r.logprobs, atol=2e-2, rtol=0)


def test_fp8_engine_halves_linear_weight_memory(tiny_models: dict[str, Path]) -> None:
    bf16 = TorchRolloutEngine(tiny_models["small"], "bf16")
    fp8 = TorchRolloutEngine(tiny_models["small"], "fp8")
    linear_bf16 = sum(m.weight.numel() * 2 for n, m in bf16.model.named_modules() if n in set(fp8.fp8_modules))
    saved = bf16.weight_bytes() - fp8.weight_bytes()
    assert saved == pytest.approx(linear_bf16 / 2, rel=0.01)


def test_greedy_stops_at_eos(tiny_models: dict[str, Path]) -> None:
    engine = TorchRolloutEngine(tiny_models["tiny"], "fp8")
    r = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))
    for row, mask in zip(r.response_ids.tolist(), r.response_mask.tolist(), strict=True):
        n = int(sum(mask))
        assert engine.eos_token_id not in row[: n - 1]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_sync_is_bit_exact_and_versioned(tiny_models: dict[str, Path], precision: str) -> None:
    spec = QuantSpec()
    engine = TorchRolloutEngine(tiny_models["tiny"], precision, spec)
    trainer = TorchTrainer(
        tiny_models["tiny"], TrainerOptions(precision=precision, optim=OptimConfig(lr=1e-2, warmup_steps=0))
    )
    r = engine.generate(PROMPTS * 4, SamplingParams(max_tokens=4, seed=0))
    batch = build_batch(r.prompt_ids, r.response_ids, r.response_mask, 0)
    old = trainer.compute_logprobs(batch, 1.0)
    adv = torch.linspace(-1, 1, 12)
    before = {k: v.clone() for k, v in trainer.hf_state_dict().items()}
    m = trainer.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, r.response_mask), GRPOConfig(), 1.0))
    after = trainer.hf_state_dict()
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert m["grad_norm"] > 0 and len(changed) == len(after)  # every parameter moved
    sync = InProcessSync(engine, lambda: after, {n + ".weight" for n in engine.fp8_modules}, spec, verify=True)
    stats = sync.push(version=1)
    assert engine.policy_version == 1 and stats.verified
    name = "model.layers.0.mlp.up_proj.weight"
    held = engine.held_weights()[name]
    if precision == "fp8":
        assert isinstance(held, QuantizedTensor)
        assert torch.equal(held.data.view(torch.uint8), quantize_weight(after[name], spec).data.view(torch.uint8))
        bf16_bytes = sum(v.numel() * 2 for v in after.values())
        assert stats.bytes_sent < bf16_bytes
    else:
        assert torch.equal(held, after[name])
    with pytest.raises(SyncVerificationError, match="policy version"):
        verify_engine_weights(engine, {}, version=2)
    engine.load_weights({"lm_head.weight": torch.zeros_like(after["lm_head.weight"])}, version=1)
    with pytest.raises(SyncVerificationError, match=r"lm_head.weight: engine weight differs"):
        verify_engine_weights(engine, {"lm_head.weight": after["lm_head.weight"]}, version=1)


def test_bf16_layers_stay_high_precision(tiny_models: dict[str, Path]) -> None:
    engine = TorchRolloutEngine(tiny_models["small"], "fp8", QuantSpec(), bf16_first_layers=1, bf16_last_layers=1)
    assert all(".layers.1." in n or ".layers.2." in n for n in engine.fp8_modules)
    assert len(engine.fp8_modules) == 14
    trainer = TorchTrainer(
        tiny_models["small"],
        TrainerOptions(
            precision="fp8", bf16_first_layers=1, bf16_last_layers=1, optim=OptimConfig(lr=2e-5, warmup_steps=0)
        ),
    )
    assert trainer.fp8_modules == engine.fp8_modules
    assert type(trainer.model.get_submodule("model.layers.0.mlp.up_proj")) is nn.Linear
