"""RL math: group advantages, the PPO-clip policy loss, mismatch correction and metrics.

Pure functions over tensors (no I/O, no model, no distributed state), importing
only torch, the standard library and the typed settings of ``fp8rl.config`` (which
imports no torch); every function documents its shapes and the formula with its
source.

Conventions
    Token tensors are [N, T]: N sequences, T response tokens, right-padded.
    ``mask`` [N, T] is bool or float, non-zero (1) for real response tokens;
    masked positions never reach a value or a gradient, whatever they hold.
    Functions that report return ``(value, metrics)`` with ``metrics`` a
    ``dict[str, float]`` (one host sync per call).

Pieces
    :func:`grpo_advantages`      GRPO / Dr. GRPO / RLOO advantages from rewards [N].
    :func:`policy_loss`          PPO-clip with clip-higher, dual clip, IS weights,
                                 k3 reference KL, token- or sequence-mean.  GRPO and
                                 DAPO are configurations (``fp8rl.config.GRPOConfig``).
    :func:`mismatch_correction`  TIS / MIS weights and mask for the rollout/training
                                 numerics mismatch (e.g. FP8 vLLM vs the trainer),
                                 as the recipe's ``correction`` says.
    :func:`mismatch_metrics`     token_mult_prob_error, KLs, JS, |p - q| between the
                                 rollout engine's and the trainer's log-probs.

A training step, in order (``cfg`` a ``fp8rl.config.RunConfig``)::

    adv = grpo_advantages(rewards, cfg.grpo.group_size)
    w, mask, corr_metrics = mismatch_correction(old_lp, rollout_lp, mask, cfg.recipe.correction)
    loss, loss_metrics = policy_loss(PolicyLossInput(lp, old_lp, adv, mask, is_weights=w), cfg.grpo)
"""

from fp8rl.rl.advantages import grpo_advantages
from fp8rl.rl.correction import mismatch_correction
from fp8rl.rl.loss import (
    DUAL_CLIP_YE_ET_AL,
    LossAgg,
    PolicyLossInput,
    aggregate_token_loss,
    policy_loss,
    policy_loss_stats,
    ppo_clip_token_loss,
    stats_row,
)
from fp8rl.rl.metrics import bernoulli_js_divergence, kl_k3, masked_max, masked_mean, masked_sum, mismatch_metrics

__all__ = [
    "DUAL_CLIP_YE_ET_AL",
    "LossAgg",
    "PolicyLossInput",
    "aggregate_token_loss",
    "bernoulli_js_divergence",
    "grpo_advantages",
    "kl_k3",
    "masked_max",
    "masked_mean",
    "masked_sum",
    "mismatch_correction",
    "mismatch_metrics",
    "policy_loss",
    "policy_loss_stats",
    "ppo_clip_token_loss",
    "stats_row",
]
