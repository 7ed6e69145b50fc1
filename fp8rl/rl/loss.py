"""The PPO-clip policy loss; GRPO, DAPO and Dr. GRPO are configurations of it.

GRPO is this loss fed with :func:`fp8rl.rl.grpo_advantages` (and ``kl_coef`` for
its reference-KL term); DAPO is clip-higher (``clip_high=0.28``) with
``token-mean`` aggregation; there is no second implementation.  The rollout /
training mismatch correction enters as per-token ``is_weights`` from
:func:`fp8rl.rl.mismatch_correction`.  The settings are the run config's ``grpo``
section, ``fp8rl.config.GRPOConfig`` (its docstring gives each one's source);
the loss reads clip_low, clip_high, dual_clip, loss_agg and kl_coef.

Numerics: the loss is computed in float32 even for bf16 log-probabilities (float64
stays float64).  Masked positions are selected away with ``torch.where`` before
any exp, so whatever sits there (padding, NaN, -inf) contributes exactly zero to
the loss and to every gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fp8rl.config import GRPOConfig, LossAgg
from fp8rl.rl.metrics import as_bool_mask, kl_k3, masked_max, masked_mean, require_same_shape

DUAL_CLIP_YE_ET_AL = 3.0
"""The dual-clip constant of Ye et al. (2020) and veRL's ``clip_ratio_c`` default."""

LOG_RATIO_LIMIT = 20.0
"""|log ratio| is clamped to this before exp, as veRL does: a wildly off-policy
token gives a large finite loss (and no gradient) instead of inf."""


@dataclass(frozen=True)
class PolicyLossInput:
    """The tensors of one :func:`policy_loss` call; N sequences of T response tokens.

    logprobs:     [N, T] log pi_theta of the sampled tokens, with grad (current
                  policy, training numerics).
    old_logprobs: [N, T] log pi_old of the same tokens: the behaviour policy under
                  training numerics (detached here).
    advantages:   [N] per-sequence advantages, broadcast to tokens, or [N, T].
    mask:         [N, T] bool or float, non-zero for real response tokens.
    is_weights:   optional [N, T] per-token importance weights of the rollout /
                  training mismatch correction; detached here, multiplied into the
                  per-token policy-gradient loss.
    ref_logprobs: optional [N, T] log pi_ref for the k3 KL penalty and metric.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    is_weights: Tensor | None = None
    ref_logprobs: Tensor | None = None

    def __post_init__(self) -> None:
        require_same_shape(
            logprobs=self.logprobs,
            old_logprobs=self.old_logprobs,
            mask=self.mask,
            is_weights=self.is_weights,
            ref_logprobs=self.ref_logprobs,
        )
        if self.logprobs.dim() != 2:
            raise ValueError(f"logprobs must be [N, T], got shape {list(self.logprobs.shape)}")
        n = self.logprobs.shape[0]
        if tuple(self.advantages.shape) not in ((n,), tuple(self.logprobs.shape)):
            raise ValueError(
                f"advantages must be [N] or [N, T] = {list(self.logprobs.shape)}, got {list(self.advantages.shape)}"
            )


def ppo_clip_token_loss(ratio: Tensor, advantages: Tensor, cfg: GRPOConfig) -> Tensor:
    """Per-token PPO-clip loss (to minimise), optionally dual-clipped.

    Shapes: ratio, advantages [N, T] -> [N, T].  With r = ratio, A = advantage,
    eps_l = clip_low, eps_h = clip_high (Schulman et al. 2017; asymmetric as DAPO):

        l = max(-r * A, -clip(r, 1 - eps_l, 1 + eps_h) * A)     (= -min(rA, clip(r)A))
        dual clip (A < 0 only):  l = min(l, -c * A)              (Ye et al. 2020; veRL)

    The clipped branch has zero gradient: A > 0 with r > 1 + eps_h, A < 0 with
    r < 1 - eps_l, and under dual clip A < 0 with r > c.
    """
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    if cfg.dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -cfg.dual_clip * advantages), loss)
    return loss


def aggregate_token_loss(token_loss: Tensor, mask: Tensor, loss_agg: LossAgg) -> Tensor:
    """Reduce a per-token loss [N, T] to a scalar over the tokens of ``mask`` [N, T].

        token-mean:           sum_{i,t} m_it l_it / sum_{i,t} m_it
        seq-mean-token-mean:  mean over non-empty sequences i of sum_t m_it l_it / sum_t m_it

    (veRL ``agg_loss``.)  Sequences with no valid token are skipped; an all-empty
    batch gives 0 with the graph kept, so ``backward()`` still works.
    """
    valid = as_bool_mask(mask)
    if loss_agg == "token-mean":
        return masked_mean(token_loss, valid)
    if loss_agg == "seq-mean-token-mean":
        return masked_mean(masked_mean(token_loss, valid, dim=1), valid.any(dim=1))
    raise ValueError(f"unknown loss_agg {loss_agg!r}")


def policy_loss(inp: PolicyLossInput, cfg: GRPOConfig) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip policy-gradient loss with optional IS weights and k3 reference KL; see :func:`policy_loss_stats`
    (this is it with the metrics read back as floats: one device-to-host copy)."""
    loss, stats = policy_loss_stats(inp, cfg)
    return loss, dict(zip(stats, stats_row(stats).tolist(), strict=True))


def stats_row(stats: dict[str, Tensor]) -> Tensor:
    """The 0-d metric tensors of :func:`policy_loss_stats` as one float64 row (in the dict's order), on their
    device: a caller summing them over micro-batches reads them back once, at the end of its step."""
    return torch.stack([v.detach().double() for v in stats.values()])


def policy_loss_stats(inp: PolicyLossInput, cfg: GRPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip policy-gradient loss with optional IS weights and k3 reference KL, and its metrics as 0-d
    tensors on the loss's device (no synchronisation with the device: reading them is the caller's choice).

    Shapes: see :class:`PolicyLossInput`; returns a scalar loss with grad w.r.t.
    ``inp.logprobs`` and metrics.  Per token, with ratio = exp(lp - lp_old):

        l_t = w_t * ppo_clip(ratio_t, A)  +  kl_coef * k3(lp_t, lp_ref_t)

    where w_t are ``is_weights`` (1 if None), ``ppo_clip`` is
    :func:`ppo_clip_token_loss` and k3 = exp(ref - lp) - (ref - lp) - 1 (Schulman
    2020); then reduced by :func:`aggregate_token_loss`.  The log ratio is clamped
    to +-:data:`LOG_RATIO_LIMIT` before the exp.

    Metrics (token-weighted over valid tokens): ``loss``; ``pg_loss`` (the first
    term alone, same aggregation); ``ratio_mean``, ``ratio_max``;
    ``clip_frac_low`` (A < 0, ratio < 1 - clip_low) and ``clip_frac_high`` (A > 0,
    ratio > 1 + clip_high), the tokens whose clipped branch is active;
    ``clip_frac_dual`` (A < 0, ratio > c) when dual clip is on; ``kl_ref`` (mean
    k3) when ``ref_logprobs`` is given.
    """
    if cfg.kl_coef > 0.0 and inp.ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    valid = as_bool_mask(inp.mask)
    dtype = torch.promote_types(inp.logprobs.dtype, torch.float32)
    lp = inp.logprobs.to(dtype)
    log_ratio = torch.where(valid, lp - inp.old_logprobs.detach().to(dtype), 0.0)
    ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    adv = inp.advantages.detach().to(dtype)
    adv = (adv[:, None] if adv.dim() == 1 else adv).expand_as(ratio)

    pg_token = ppo_clip_token_loss(ratio, adv, cfg)
    if inp.is_weights is not None:
        pg_token = pg_token * inp.is_weights.detach().to(dtype)
    token_loss = pg_token
    kl = None
    if inp.ref_logprobs is not None:
        # Both sides selected, so a NaN in padding cannot reach lp's gradient.
        ref = torch.where(valid, inp.ref_logprobs.detach().to(dtype), 0.0)
        kl = kl_k3(torch.where(valid, lp, 0.0), ref)
        if cfg.kl_coef > 0.0:
            token_loss = pg_token + cfg.kl_coef * kl
    loss = aggregate_token_loss(token_loss, valid, cfg.loss_agg)
    with torch.no_grad():
        pg_loss = aggregate_token_loss(pg_token, valid, cfg.loss_agg) if kl is not None else loss
        stats = {"loss": loss, "pg_loss": pg_loss, **_ratio_stats(ratio, adv, valid, cfg)}
        if kl is not None:
            stats["kl_ref"] = masked_mean(kl, valid)
    return loss, {k: v.detach() for k, v in stats.items()}


def _ratio_stats(ratio: Tensor, adv: Tensor, valid: Tensor, cfg: GRPOConfig) -> dict[str, Tensor]:
    """The ratio's mean and max, and the fractions of valid tokens whose clipped branch is active."""
    stats = {
        "ratio_mean": masked_mean(ratio, valid),
        "ratio_max": masked_max(ratio, valid),
        "clip_frac_low": masked_mean(((adv < 0) & (ratio < 1.0 - cfg.clip_low)).to(ratio.dtype), valid),
        "clip_frac_high": masked_mean(((adv > 0) & (ratio > 1.0 + cfg.clip_high)).to(ratio.dtype), valid),
    }
    if cfg.dual_clip is not None:
        stats["clip_frac_dual"] = masked_mean(((adv < 0) & (ratio > cfg.dual_clip)).to(ratio.dtype), valid)
    return stats
