"""Where a policy step's old-policy logprobs, importance weights and loss mask come from, micro-batch by micro-batch.

``RecomputedOld``: from a separate no-grad forward over the whole batch before the step (``compute_logprobs``),
with the mismatch correction computed on the whole batch.

``TrainForwardOld``: from the step's own forward.  When one optimizer step consumes the whole rollout batch (fp8rl's
``policy_step`` always does: one PPO/GRPO iteration, one mini-batch) the behaviour policy IS the policy before the
update, so the old logprobs equal the train forward's logprobs, detached, and the PPO ratio is exactly 1 (TRL skips
the recompute when ``num_iterations == 1``).  The separate forward is then pure cost.  The mismatch metrics and the
TIS/MIS weights are computed per micro-batch from those logprobs and the engine's; every row is one sequence, so
sequence-level weights are the same as the batch's.  Token-weighted means over the batch become sums of each
micro-batch's mean weighted by its share of the batch's valid tokens (float64; the maxima are maxima).

MIS can drop tokens, which changes the loss's denominators (valid tokens, or sequences) after the first micro-batch
has already run its backward.  The micro-batches are then weighted by the denominators of the input mask, and the
summed gradients (and loss metrics) are rescaled by input / kept before clipping (``grad_scale``); data-parallel
ranks add their kept counts first.  Without MIS the mask does not change, the scale is 1 and nothing is rescaled:
the update is the recompute path's bit for bit where the two forwards agree bit for bit
(``tests/unit/test_old_logprobs_from_train_forward.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fp8rl.config import Correction, GRPOConfig
from fp8rl.rl.correction import CORRECTION_MAXIMA, correction_stats, ess_from_moments
from fp8rl.rl.metrics import MISMATCH_MAXIMA, mismatch_stats
from fp8rl.train.batches import SequenceBatch, micro_batch_weight, policy_batch_totals
from fp8rl.train.model_inputs import to_device

MISMATCH, CORRECTION = "mismatch/", "correction/"
# the keys of TrainForwardOld's metrics that are maxima (data-parallel ranks: the largest, not the sum)
MAXIMA = tuple(MISMATCH + k for k in MISMATCH_MAXIMA) + tuple(CORRECTION + k for k in CORRECTION_MAXIMA)


@dataclass
class MicroBatchTerms:
    """What the loss of one micro-batch takes besides its logprobs and advantages (on the device)."""

    old_logprobs: Tensor  # [n, T]
    is_weights: Tensor | None  # [n, T]
    loss_mask: Tensor  # [n, T]
    weight: float | Tensor  # the micro-batch loss's weight in the batch's (``micro_batch_weight``)


@dataclass(frozen=True)
class RecomputedOld:
    """Old logprobs, IS weights and loss mask ``[N, T]`` given for the whole batch (host tensors)."""

    old_logprobs: Tensor
    is_weights: Tensor | None
    loss_mask: Tensor

    def rows(self, sl: slice) -> RecomputedOld:
        """The rows ``sl`` of the batch (a data-parallel rank's share)."""
        return RecomputedOld(self.old_logprobs[sl], None if self.is_weights is None else self.is_weights[sl],
                             self.loss_mask[sl])  # fmt: skip

    def host_mask(self, sl: slice) -> Tensor:
        return self.loss_mask[sl]

    def terms(self, sl: slice, lp: Tensor, loss_agg: str, totals: tuple[float, float]) -> MicroBatchTerms:
        device = lp.device
        return MicroBatchTerms(
            old_logprobs=to_device(self.old_logprobs[sl], device),
            is_weights=None if self.is_weights is None else to_device(self.is_weights[sl], device),
            loss_mask=to_device(self.loss_mask[sl], device),
            weight=micro_batch_weight(self.loss_mask[sl], loss_agg, totals),
        )

    def finish(self, loss_agg: str, totals: tuple[float, float], all_ranks_sum: Callable[[Tensor], None]) -> float:
        return 1.0

    def metrics(self) -> dict[str, float]:
        return {}


@dataclass
class TrainForwardOld:
    """Old logprobs from the train forward: the engine's logprobs ``rollout_logprobs`` and the rollout's response
    ``mask`` ``[N, T]`` (host tensors) and the recipe's ``correction``; see the module docstring."""

    rollout_logprobs: Tensor
    mask: Tensor
    correction: Correction
    # what one update gathers; not init fields, so ``dataclasses.replace`` gives a copy with none (``PolicyStep``)
    _sums: dict[str, Tensor] = field(default_factory=dict, init=False)
    _kept: list[Tensor] = field(default_factory=list, init=False)  # MIS: the kept (tokens, sequences) a micro-batch

    def rows(self, sl: slice) -> TrainForwardOld:
        """The rows ``sl`` of the batch (a data-parallel rank's share)."""
        return TrainForwardOld(self.rollout_logprobs[sl], self.mask[sl], self.correction)

    def host_mask(self, sl: slice) -> Tensor:
        return self.mask[sl]

    def terms(self, sl: slice, lp: Tensor, loss_agg: str, totals: tuple[float, float]) -> MicroBatchTerms:
        old = lp.detach()
        mask = to_device(self.mask[sl], lp.device)
        rollout = to_device(self.rollout_logprobs[sl], lp.device)
        weights, loss_mask, corr = correction_stats(old, rollout, mask, self.correction)
        share = float(self.mask[sl].sum()) / totals[0]  # of the batch's valid tokens: the metrics' weight
        self._add({MISMATCH + k: v for k, v in mismatch_stats(rollout, old, mask).items()}, share)
        self._add({CORRECTION + k: v for k, v in corr.items() if k != "is_ess"}, share)
        if self.correction.type != "mis":  # the mask is the input's: the recompute path's weights exactly
            return MicroBatchTerms(old, weights, loss_mask, micro_batch_weight(self.mask[sl], loss_agg, totals))
        kept = torch.stack([loss_mask.sum(), (loss_mask.sum(-1) > 0).sum()]).double()
        self._kept.append(kept)
        # provisional denominators, the input mask's; ``finish`` rescales to the kept ones
        weight = (kept[0] / totals[0] if loss_agg == "token-mean" else kept[1] / totals[1]).float()
        return MicroBatchTerms(old, weights, loss_mask, weight)

    def _add(self, stats: dict[str, Tensor], share: float) -> None:
        for k, v in stats.items():
            if k in MAXIMA:
                self._sums[k] = torch.maximum(self._sums[k], v) if k in self._sums else v
            else:
                self._sums[k] = self._sums[k] + v * share if k in self._sums else v * share

    def finish(self, loss_agg: str, totals: tuple[float, float], all_ranks_sum: Callable[[Tensor], None]) -> float:
        """The factor the summed gradients and loss metrics take before clipping: the input mask's denominator over
        the kept one (every rank's), 1.0 without MIS.  A collective where ``all_ranks_sum`` is one."""
        if not self._kept:
            return 1.0
        kept = torch.stack(self._kept).sum(0)
        all_ranks_sum(kept)
        i = 0 if loss_agg == "token-mean" else 1
        return totals[i] / float(kept[i].clamp(min=1))

    def metrics(self) -> dict[str, float]:
        """The mismatch and correction metrics (this rank's share of the batch's), ``mismatch/`` and
        ``correction/`` keys; ``correction/is_ess`` is left to ``ess_metric`` (a ratio: ranks add the moments)."""
        if not self._sums:
            return {}
        return dict(zip(self._sums, torch.stack(list(self._sums.values())).tolist(), strict=True))


@dataclass(frozen=True)
class PolicyStep:
    """One policy step's input, passed whole from the RL loop through the Ray actors to the trainer.

    ``batch``: N sequences; ``advantages [N]``; ``old``: where the old logprobs, IS weights and loss mask come from
    (``RecomputedOld``: given; ``TrainForwardOld``: the step's own forward); ``loss_cfg``: the PPO-clip/GRPO loss;
    ``temperature``: the sampling temperature the logprobs are taken at; ``totals``: (valid tokens, valid sequences)
    of the batch the loss is aggregated over, ``None`` for this one's (a data-parallel rank gets the whole batch's).
    """

    batch: SequenceBatch
    advantages: Tensor
    old: RecomputedOld | TrainForwardOld
    loss_cfg: GRPOConfig
    temperature: float
    totals: tuple[float, float] | None = None

    def batch_totals(self) -> tuple[float, float]:
        return self.totals or policy_batch_totals(self.old.host_mask(slice(None)))

    def rows(self, sl: slice) -> PolicyStep:
        """A data-parallel rank's share: the rows ``sl``, with the whole batch's totals."""
        return PolicyStep(self.batch.slice(sl), self.advantages[sl], self.old.rows(sl), self.loss_cfg,
                          self.temperature, self.batch_totals())  # fmt: skip


def ess_metric(metrics: dict[str, float]) -> dict[str, float]:
    """``correction/is_ess`` from the batch's ``correction/is_weight_mean`` and ``is_weight_sq_mean`` (ranks'
    shares summed), which it replaces; ``{}`` where the metrics hold no moments."""
    mean, sq = metrics.get(CORRECTION + "is_weight_mean"), metrics.pop(CORRECTION + "is_weight_sq_mean", None)
    if mean is None or sq is None:
        return {}
    t = torch.tensor
    ess = ess_from_moments(t(mean, dtype=torch.float64), t(sq, dtype=torch.float64), t(1.0, dtype=torch.float64))
    return {CORRECTION + "is_ess": float(ess)}
