"""Rollout / training mismatch correction: truncated (TIS) or masked (MIS) importance sampling.

The rollout engine (FP8 vLLM, its own kernels) samples from pi_rollout, which is not
quite the policy the trainer evaluates, pi_train, even at the same weights.  The
policy gradient is an expectation under pi_train, so each token gets the ratio

    rho_t = pi_train(y_t) / pi_rollout(y_t) = exp(lp_train_t - lp_rollout_t)

where lp_train are the behaviour (old) log-probabilities recomputed by the trainer
and lp_rollout those the engine reported.  Raw ratios have unbounded variance, so:

    tis  truncated IS, w = min(rho, C): Yao et al. 2025, "Your Efficient RL Framework
         Secretly Brings You Off-Policy RL Training"; veRL's rollout importance
         sampling in "truncate" mode.
    mis  masked IS: tokens (or whole sequences) whose ratio leaves [low, high] are
         dropped from the loss instead of down-weighted; Liu et al. 2025, "When Speed
         Kills Stability: Demystifying RL Collapse from the Training-Inference
         Mismatch"; veRL's "mask" mode.

at the level of single tokens (rho_t) or of whole sequences (prod_t rho_t, taken in
log space: sum_t log rho_t, so long sequences cannot overflow).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fp8rl.config import Correction, MISCorrection, TISCorrection
from fp8rl.rl.metrics import as_bool_mask, masked_max, masked_mean, masked_sum, require_same_shape


def _ess(weights: Tensor, valid: Tensor) -> Tensor:
    """Normalized effective sample size (sum w)^2 / (n sum w^2) in [0, 1]; 1 for no tokens."""
    n = valid.sum().to(weights.dtype)
    sum_w = masked_sum(weights, valid)
    sum_w2 = masked_sum(weights * weights, valid)
    ess = torch.where(sum_w2 > 0, sum_w**2 / (n * sum_w2).clamp(min=torch.finfo(weights.dtype).tiny), 0.0)
    # Cauchy-Schwarz bounds it by 1; clamp away rounding above.
    return torch.where(n > 0, ess.clamp(max=1.0), 1.0)


CORRECTION_MAXIMA = ("is_weight_max",)
"""The metrics of :func:`correction_stats` that are maxima; ``is_ess`` is a ratio of two means
(:func:`ess_from_moments`), the rest are means over the valid tokens."""


def mismatch_correction(
    train_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    cfg: Correction,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Per-token IS weights and the (possibly reduced) loss mask for the mismatch: :func:`correction_stats` with
    its metrics read back as floats (one device-to-host copy), ``is_weight_sq_mean`` left out."""
    weights, new_mask, stats = correction_stats(train_logprobs, rollout_logprobs, mask, cfg)
    stats.pop("is_weight_sq_mean")
    values = torch.stack(list(stats.values())).tolist()
    return weights, new_mask, dict(zip(stats, values, strict=True))


def ess_from_moments(weight_mean: Tensor, weight_sq_mean: Tensor, tokens: Tensor) -> Tensor:
    """Normalized effective sample size from the weights' first two moments over n tokens:
    (sum w)^2 / (n sum w^2) = mean(w)^2 / mean(w^2), in [0, 1]; 1 for no tokens, 0 if every weight is 0."""
    ess = torch.where(
        weight_sq_mean > 0, weight_mean**2 / weight_sq_mean.clamp(min=torch.finfo(weight_mean.dtype).tiny), 0.0
    )
    return torch.where(tokens > 0, ess.clamp(max=1.0), 1.0)  # Cauchy-Schwarz bounds it by 1: rounding above goes


def _weights(
    log_rho: Tensor, valid: Tensor, mask: Tensor, cfg: Correction, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``correction_stats``' weights and new mask for ``cfg``, and the tokens it clips (tis) or drops (mis)."""
    if isinstance(cfg, TISCorrection):
        flagged = valid & (log_rho > math.log(cfg.threshold))
        return torch.where(valid, log_rho.clamp(max=math.log(cfg.threshold)).exp(), 0.0), mask, flagged
    if isinstance(cfg, MISCorrection):
        keep = valid & (log_rho >= math.log(cfg.low)) & (log_rho <= math.log(cfg.high))
        return keep.to(dtype), torch.where(keep, mask, torch.zeros_like(mask)), valid & ~keep
    return valid.to(dtype), mask, None


def correction_stats(
    train_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    cfg: Correction,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Per-token IS weights and the (possibly reduced) loss mask for the mismatch, and its metrics as 0-d float64
    tensors on the inputs' device (no synchronisation with the device).

    ``cfg`` is the recipe's correction (``fp8rl.config``: ``NoCorrection``, ``TISCorrection`` with
    ``level`` and ``threshold`` C, or ``MISCorrection`` with ``level`` and the window [low, high]).

    Shapes: train_logprobs [N, T] (old log-probs under training numerics),
    rollout_logprobs [N, T] (as reported by the rollout engine), mask [N, T] bool or
    float.  Returns ``(weights, new_mask, metrics)``: weights [N, T], float32 (float64
    for float64 inputs), detached, 0 outside ``new_mask``; new_mask [N, T] of
    ``mask``'s dtype.  With log rho = lp_train - lp_rollout (per token, or summed
    over the sequence's valid tokens for level="sequence"; a row is one sequence, so
    any set of whole rows gives the same weights as the batch):

        none  w = 1;                 new_mask = mask
        tis   w = exp(min(log rho, log C)) = min(rho, C);   new_mask = mask
        mis   w = 1;  new_mask = mask and log(low) <= log rho <= log(high)

    Metrics, over the tokens of the input ``mask`` with the final weights (a token
    MIS drops counts as weight 0): ``is_weight_mean``, ``is_weight_max``,
    ``is_weight_sq_mean`` (mean w^2), ``is_ess`` = (sum w)^2 / (n sum w^2) (1 for
    identical log-probs; 0 if every token was dropped), and ``frac_clipped`` (tis:
    tokens with rho > C) or ``frac_masked`` (mis: tokens dropped).  At sequence level
    these count the tokens of the affected sequences.
    """
    require_same_shape(train_logprobs=train_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    valid = as_bool_mask(mask)
    dtype = torch.promote_types(train_logprobs.dtype, torch.float32)
    diff = train_logprobs.detach().to(dtype) - rollout_logprobs.detach().to(dtype)
    log_rho = torch.where(valid, diff, 0.0)
    if isinstance(cfg, TISCorrection | MISCorrection) and cfg.level == "sequence":
        log_rho = masked_sum(log_rho, valid, dim=1)[:, None].expand_as(log_rho)

    weights, new_mask, flagged = _weights(log_rho, valid, mask, cfg, dtype)
    stats = {
        "is_weight_mean": masked_mean(weights, valid).double(),
        "is_weight_max": masked_max(weights, valid).double(),
        "is_ess": _ess(weights.double(), valid),
        "is_weight_sq_mean": masked_mean(weights.double() ** 2, valid),
    }
    if flagged is not None:
        stats["frac_clipped" if cfg.type == "tis" else "frac_masked"] = masked_mean(flagged.to(dtype), valid).double()
    return weights, new_mask, stats
