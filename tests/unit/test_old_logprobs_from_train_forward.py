"""``grpo.old_logprobs: train_forward`` against ``recompute``: the old policy's logprobs taken from the policy step's own
forward (``fp8rl.train.old_logprobs``) give the update of a separate no-grad logprob pass before the step.

One step from the same checkpoint both ways, 10 rows in micro-batches of 4 (so the mismatch metrics and the IS weights
are combined over three micro-batches), the engine's logprobs the trainer's plus noise (TIS caps some tokens, MIS
drops some).  Without MIS the loss mask and weights are the recompute path's: gradients, parameters, loss and ratio
metrics must match bit for bit.  With MIS the micro-batches' backwards run at the input mask's loss scale and the summed
gradients are rescaled after them (input tokens / kept tokens), so the bf16 (FP8) backwards round differently: measured
here, each gradient within 0.9% (6.3%) of its norm and the grad norm within 1.9e-4 relative; the bounds are about twice
that.  AdamW's first step, lr * g / (|g| + eps), turns such a difference into up to 2 lr where a gradient element
crosses 0, which bounds the parameters.  The mismatch
metrics are float64 sums of the micro-batches' weighted means: 1e-12 relative; the correction's means are of float32
weights (as the recompute path's), summed in another order: 1e-6 relative.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fp8rl.config import Correction, GRPOConfig, MISCorrection, NoCorrection, OptimConfig, TISCorrection
from fp8rl.rl import mismatch_correction, mismatch_metrics
from fp8rl.train.old_logprobs import CORRECTION, MISMATCH, PolicyStep, RecomputedOld, TrainForwardOld, ess_metric
from fp8rl.train.trainer import TorchTrainer, TrainerOptions

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from sharded_trainer_worker import fixed_batch  # 10 rows, one with a short response

LR = 1e-3


def _trainer(path: Path, precision: str) -> TorchTrainer:
    torch.manual_seed(0)
    return TorchTrainer(
        path, TrainerOptions(precision=precision, optim=OptimConfig(micro_batch_size=4, lr=LR, warmup_steps=0))
    )


def _recording_grads(trainer: TorchTrainer) -> list[torch.Tensor]:
    """The fp32 gradients AdamW steps with (after any rescale and the clip), recorded at the step."""
    seen: list[torch.Tensor] = []
    adamw = trainer.optimizer.optimizer
    step = adamw.step

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.extend(m.grad.clone() for m in trainer.optimizer.master)
        return step(*args, **kwargs)

    adamw.step = recorded  # type: ignore[method-assign]
    return seen


def _engine_logprobs(train_lp: torch.Tensor) -> torch.Tensor:
    """The rollout engine's logprobs of the same tokens: the trainer's plus noise wide enough to cross TIS's cap
    (log 2) and MIS's window ([log 0.5, log 2]) on some tokens."""
    noise = torch.randn(train_lp.shape, generator=torch.Generator().manual_seed(1)) * 0.6
    return (train_lp + noise).clamp(max=0.0)


def _recomputed(
    trainer: TorchTrainer, batch, adv, rollout_lp, mask, grpo: GRPOConfig, correction: Correction
) -> dict[str, float]:
    """The loop's ``recompute`` path: a logprob pass, the metrics and correction on the whole batch, the step."""
    old = trainer.compute_logprobs(batch, 1.0)
    mm = mismatch_metrics(rollout_lp, old, mask)
    w, loss_mask, corr = mismatch_correction(old, rollout_lp, mask, correction)
    m = trainer.policy_step(PolicyStep(batch, adv, RecomputedOld(old, w, loss_mask), grpo, 1.0))
    return {**m, **{MISMATCH + k: v for k, v in mm.items()}, **{CORRECTION + k: v for k, v in corr.items()}}


def _from_train_forward(
    trainer: TorchTrainer, batch, adv, rollout_lp, mask, grpo: GRPOConfig, correction: Correction
) -> dict[str, float]:
    m = trainer.policy_step(PolicyStep(batch, adv, TrainForwardOld(rollout_lp, mask, correction), grpo, 1.0))
    ess = ess_metric(m)  # takes the weights' second moment out of m
    return {**m, **ess}


CASES = [
    ("bf16", NoCorrection(), "token-mean"),
    ("bf16", TISCorrection(), "token-mean"),
    ("fp8", TISCorrection(), "token-mean"),
    ("bf16", TISCorrection(level="sequence", threshold=5.0), "seq-mean-token-mean"),
    ("bf16", MISCorrection(), "token-mean"),
    ("fp8", MISCorrection(), "token-mean"),
    ("bf16", MISCorrection(level="sequence", low=0.05, high=20.0), "seq-mean-token-mean"),
]


@pytest.mark.parametrize(("precision", "correction", "loss_agg"), CASES, ids=lambda v: getattr(v, "type", v))
def test_the_train_forwards_old_logprobs_give_the_recomputed_update(
    tiny_models: dict[str, Path], precision: str, correction: Correction, loss_agg: str
) -> None:
    batch, adv, _, mask = fixed_batch(loss_on_every_rank=True)
    grpo = GRPOConfig(loss_agg=loss_agg)
    ref, fused = _trainer(tiny_models["tiny"], precision), _trainer(tiny_models["tiny"], precision)
    rollout_lp = _engine_logprobs(ref.compute_logprobs(batch, 1.0))
    before = {n: p.detach().clone() for n, p in ref.model.named_parameters()}

    grads_want, grads_got = _recording_grads(ref), _recording_grads(fused)
    want = _recomputed(ref, batch, adv, rollout_lp, mask, grpo, correction)
    got = _from_train_forward(fused, batch, adv, rollout_lp, mask, grpo, correction)

    # the case tests what it claims: the correction acted on some tokens, and the step moved the weights
    flagged = want.get(CORRECTION + "frac_clipped", want.get(CORRECTION + "frac_masked", 1.0))
    assert flagged > 0.0
    assert want["grad_norm"] > 0.0
    assert set(got) == set(want)
    exact = correction.type != "mis"
    changed = 0
    for (name, p_ref), (_, p_got) in zip(ref.model.named_parameters(), fused.model.named_parameters(), strict=True):
        changed += int(not torch.equal(p_ref, before[name]))
        if exact:
            assert torch.equal(p_got, p_ref), name
        else:
            # AdamW's first step is lr * g / (|g| + eps): a gradient element that rounding moves across 0 moves its
            # weight by up to 2 lr (plus the bf16 rounding of the weight)
            assert (p_got.float() - p_ref.float()).abs().max() <= 2 * LR * (1 + 2**-6) + 2**-8, name
    assert changed > 0
    for g_ref, g_got in zip(grads_want, grads_got, strict=True):
        if exact:
            assert torch.equal(g_got, g_ref)
        else:
            # the micro-batches' backwards ran at another loss scale (kept / input tokens): their bf16 (FP8)
            # gradients round differently; measured per tensor at most 0.9% (6.3%) of its norm
            err = float((g_got - g_ref).norm() / g_ref.norm().clamp(min=1e-30))
            assert err <= (0.02 if precision == "bf16" else 0.12)
    for key in ("loss", "ratio_mean", "ratio_max", "clip_frac_low", "clip_frac_high", "grad_norm"):
        if exact:
            assert got[key] == want[key], key
        else:
            # measured: loss 8e-8 relative (float32 weights), grad norm 1.9e-4 (the backwards' rounding, above)
            assert got[key] == pytest.approx(want[key], rel=5e-4 if key == "grad_norm" else 1e-6, abs=1e-7), key
    assert got["ratio_mean"] == pytest.approx(1.0, abs=0.0 if exact else 1e-6)  # on policy: the ratio is exactly 1
    for key in [k for k in want if k.startswith(MISMATCH)]:
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15), key
    for key in [k for k in want if k.startswith(CORRECTION)]:  # float32 weights' means, as the recompute path's
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key


def test_the_recompute_switch_keeps_the_logprob_phase() -> None:
    assert GRPOConfig().old_logprobs == "train_forward"
    assert GRPOConfig(old_logprobs="recompute").old_logprobs == "recompute"
    with pytest.raises(ValueError):
        GRPOConfig(old_logprobs="never")
