"""Long responses: micro-batches cut by tokens, padding columns dropped per micro-batch, responses of
thousands of tokens through the torch engine and the trainer, and the padding waste reported."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch

from fp8rl.config import GRPOConfig, OptimConfig
from fp8rl.rollout import SamplingParams, TorchRolloutEngine
from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld
from fp8rl.train.trainer import SequenceBatch, TorchTrainer, TrainerOptions, build_batch


def _ragged_batch(rows: int = 12, seed: int = 0) -> SequenceBatch:
    """Prompts of 2-9 tokens and responses of 1-30 valid tokens in a 40-wide response block."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 100, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]  # fmt: skip
    lengths = torch.randint(1, 31, (rows,), generator=g)
    mask = (torch.arange(40)[None, :] < lengths[:, None]).float()
    responses = torch.randint(3, 100, (rows, 40), generator=g) * mask.long()
    return build_batch(prompts, responses, mask, pad_id=0)


def _untrimmed_logprobs(trainer: TorchTrainer, b: SequenceBatch) -> torch.Tensor:
    with torch.no_grad():
        logits = trainer._logits(b.input_ids, b.attention_mask, b.position_ids)
    t = b.response_mask.shape[1]
    pred = logits[:, b.prompt_width - 1 : b.prompt_width - 1 + t].float().log_softmax(-1)
    return pred.gather(-1, b.input_ids[:, b.prompt_width :, None]).squeeze(-1) * b.response_mask


def test_trimmed_micro_batches_compute_what_the_padded_batch_computes(tiny_models: dict[str, Path]) -> None:
    batch = _ragged_batch()
    trimmed = batch.trimmed()
    prompt, response = batch.extents()
    assert trimmed.prompt_width == int(prompt.max()) and trimmed.response_mask.shape[1] == int(response.max())
    trainer = TorchTrainer(
        tiny_models["tiny"], TrainerOptions(optim=OptimConfig(micro_batch_tokens=120, lr=2e-5, warmup_steps=0))
    )
    slices = trainer.micro.slices(batch)
    assert slices[0].start == 0 and slices[-1].stop == 12
    assert all(a.stop == b.start for a, b in itertools.pairwise(slices))
    for s in slices:  # each within the budget, or a single row that alone exceeds it
        t = batch.slice(s).trimmed()
        assert t.input_ids.numel() <= 120 or s.stop - s.start == 1
    assert len(slices) > 1
    by_tokens = trainer.compute_logprobs(batch, 1.0)
    reference = _untrimmed_logprobs(trainer, batch)
    assert by_tokens.shape == reference.shape == (12, 40)
    torch.testing.assert_close(by_tokens, reference, atol=2e-2, rtol=0)  # bf16 forward, other shapes
    assert (by_tokens[batch.response_mask == 0] == 0).all()


def test_policy_step_reports_the_padding_it_computed(tiny_models: dict[str, Path]) -> None:
    batch = _ragged_batch()
    n, t = batch.response_mask.shape
    old = -torch.rand(n, t) * batch.response_mask
    adv = torch.linspace(-1, 1, n)
    rows = TorchTrainer(
        tiny_models["tiny"], TrainerOptions(optim=OptimConfig(micro_batch_size=64, lr=2e-5, warmup_steps=0))
    )
    tokens = TorchTrainer(
        tiny_models["tiny"], TrainerOptions(optim=OptimConfig(micro_batch_tokens=120, lr=2e-5, warmup_steps=0))
    )
    m_rows = rows.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, batch.response_mask), GRPOConfig(), 1.0))
    m_tokens = tokens.policy_step(
        PolicyStep(batch, adv, RecomputedOld(old, None, batch.response_mask), GRPOConfig(), 1.0)
    )
    valid = float(batch.attention_mask.sum())
    assert m_rows["tokens_valid"] == m_tokens["tokens_valid"] == valid
    # one micro-batch of all rows computes (longest prompt + longest response) per row; cut by tokens, less
    prompt, response = batch.extents()
    assert m_rows["tokens_computed"] == n * (int(prompt.max()) + int(response.max()))
    assert valid < m_tokens["tokens_computed"] < m_rows["tokens_computed"]
    assert m_tokens["loss"] == pytest.approx(m_rows["loss"], rel=1e-3, abs=1e-5)


@pytest.fixture(scope="module")
def long_context_model(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (random weights) with room for 4,096 positions."""
    dst = tmp_path_factory.mktemp("long") / "tiny-4k"
    shutil.copytree(tiny_models["tiny"], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_two_thousand_token_responses_through_engine_and_trainer(long_context_model: Path, precision: str) -> None:
    engine = TorchRolloutEngine(long_context_model, precision)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    r = engine.generate(prompts, SamplingParams(max_tokens=2048, seed=1, ignore_eos=True))
    assert r.response_ids.shape == (2, 2048) and r.num_tokens == 2 * 2048
    trainer = TorchTrainer(
        long_context_model,
        TrainerOptions(precision=precision, optim=OptimConfig(micro_batch_tokens=2100, lr=2e-5, warmup_steps=0)),
    )
    batch = build_batch(r.prompt_ids, r.response_ids, r.response_mask, engine.pad_token_id)
    old = trainer.compute_logprobs(batch, 1.0)
    assert old.shape == (2, 2048) and torch.isfinite(old).all()
    m = trainer.policy_step(
        PolicyStep(batch, torch.tensor([1.0, -1.0]), RecomputedOld(old, None, r.response_mask), GRPOConfig(), 1.0)
    )
    assert m["grad_norm"] > 0 and m["tokens_computed"] == (3 + 2048) + (5 + 2048)  # a row per micro-batch
    if precision == "bf16":  # the engine's own logprobs and the trainer's over 2,048 positions
        assert (old - r.logprobs).abs().mean() < 2e-2
    with pytest.raises(ValueError, match=r"sampling.max_tokens 4094 .* exceed the model's max_position_embeddings"):
        engine.generate(prompts, SamplingParams(max_tokens=4094))
