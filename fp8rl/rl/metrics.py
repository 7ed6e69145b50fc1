"""Masked reductions, the k3 KL estimator, and rollout/training mismatch metrics.

The mismatch metrics compare, token by token, the log-probability the rollout
engine reported for the sampled token (``lp_rollout``, e.g. vLLM with FP8 weights)
with the one the trainer computes for the same token (``lp_train``).  They read
only the sampled token's probability, so they are cheap and need no full
distributions; they are zero (or 1 for the multiplicative error) exactly when the
two engines agree bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor


def as_bool_mask(mask: Tensor) -> Tensor:
    """A float/bool [N, T] mask as bool: non-zero marks a real response token."""
    return mask if mask.dtype == torch.bool else mask != 0


def require_same_shape(**tensors: Tensor | None) -> None:
    """Raise ValueError unless every given (non-None) tensor has the same shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items())
        raise ValueError(f"token tensors must share one [N, T] shape, got {listed}")


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over the tokens of ``mask``; masked positions add exactly 0.

    Shapes: x [N, T], mask [N, T] (bool, or float with 1 for real tokens).
    Returns a scalar, or [N] / [T] when ``dim`` is given.  Masked positions are
    selected away (``torch.where``), not multiplied by 0, so NaN or Inf there
    neither leaks into the value nor into the gradient.
    """
    picked = torch.where(as_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the tokens of ``mask``: sum(x * mask) / max(sum(mask), 1).

    Shapes as :func:`masked_sum`.  An empty mask (or an empty row, with ``dim``)
    gives 0 rather than NaN, keeping the autograd graph connected.
    """
    count = as_bool_mask(mask).sum() if dim is None else as_bool_mask(mask).sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Largest ``x`` over the tokens of ``mask``; 0 when the mask is empty.  x, mask [N, T] -> scalar."""
    valid = as_bool_mask(mask)
    zero = x.new_zeros(())
    if x.numel() == 0:
        return zero
    filled = torch.where(valid, x, torch.full((), -torch.inf, dtype=x.dtype, device=x.device))
    return torch.where(valid.any(), filled.amax(), zero)  # no host sync


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) from tokens sampled from ``pi``.

    Shapes: logprobs [N, T] (log pi of the sampled tokens), ref_logprobs [N, T];
    returns [N, T].  With ``x = ref - lp``:

        k3 = exp(x) - x - 1        (>= 0, unbiased, low variance)

    J. Schulman, "Approximating KL Divergence" (2020); the ``low_var_kl`` of veRL
    and ``calculate_kl_penalty_joschu2020`` of NeMo RL.  Computed as
    ``expm1(x) - x`` so that it is accurate for small x.
    """
    x = ref_logprobs - logprobs
    return torch.expm1(x) - x


def _bernoulli_entropy(p: Tensor, one_minus_p: Tensor) -> Tensor:
    # xlogy(0, 0) = 0, so p = 0 or p = 1 is exact.
    return -(torch.xlogy(p, p) + torch.xlogy(one_minus_p, one_minus_p))


def bernoulli_js_divergence(lp_a: Tensor, lp_b: Tensor) -> Tensor:
    """Per-token Jensen-Shannon divergence of the sampled token's Bernoulli pairs.

    Shapes: lp_a, lp_b [N, T] log-probabilities of the same sampled tokens; returns
    [N, T] in nats, within [0, log 2].  With p = exp(lp_a), q = exp(lp_b), each
    token is the two-outcome distribution P = (p, 1 - p) against Q = (q, 1 - q), and

        JS = 1/2 KL(P || M) + 1/2 KL(Q || M),  M = (P + Q) / 2
           = H(M) - (H(P) + H(Q)) / 2,  H(a) = -a log a - (1 - a) log(1 - a)

    (natural log, 0 log 0 = 0).  The entropy form is used because it stays finite
    when p or q is exactly 1 (where the KL form divides 0 by 0), and the
    complements 1 - p are taken as -expm1(lp) so that probabilities near 1 keep
    their precision.  Log-probabilities above 0 (rounding in an engine) are read
    as 0, and rounding that pushes the difference a hair below 0 is clamped to 0.
    """
    lp_a, lp_b = lp_a.clamp(max=0.0), lp_b.clamp(max=0.0)
    p, q = lp_a.exp(), lp_b.exp()
    p_c, q_c = -torch.expm1(lp_a), -torch.expm1(lp_b)
    h_mid = _bernoulli_entropy((p + q) / 2, (p_c + q_c) / 2)
    js = h_mid - (_bernoulli_entropy(p, p_c) + _bernoulli_entropy(q, q_c)) / 2
    return js.clamp(min=0.0)


MISMATCH_MAXIMA = ("rollout_probs_diff_max",)
"""The metrics of :func:`mismatch_stats` that are maxima (the others are means over the valid tokens)."""


def mismatch_metrics(rollout_logprobs: Tensor, train_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the rollout engine's token probabilities are from the trainer's: :func:`mismatch_stats` read back
    as floats (one device-to-host copy)."""
    stats = mismatch_stats(rollout_logprobs, train_logprobs, mask)
    return dict(zip(stats, torch.stack(list(stats.values())).tolist(), strict=True))


def mismatch_stats(rollout_logprobs: Tensor, train_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the rollout engine's token probabilities are from the trainer's, as 0-d float64 tensors on the
    inputs' device (no synchronisation with the device).

    Shapes: rollout_logprobs, train_logprobs, mask [N, T].  Computed in float64
    over the tokens of ``mask`` with ``d = lp_rollout - lp_train``,
    ``p = exp(lp_rollout)``, ``q = exp(lp_train)``:

        token_mult_prob_error   = mean_t exp(|d|)       (NeMo RL; 1.0 when identical)
        gen_kl                  = mean_t exp(-d) + d - 1  (k3 with samples from the
                                  rollout policy: estimates KL(rollout || train))
        policy_kl               = mean_t exp(d) - d - 1   (the mirrored k3)
        js_divergence           = mean_t JS of the Bernoulli pairs (p, 1-p), (q, 1-q)
                                  (see :func:`bernoulli_js_divergence`; nats)
        rollout_probs_diff_max  = max_t |p - q|
        rollout_probs_diff_mean = mean_t |p - q|

    An empty mask reports the values of identical log-probabilities (1 and zeros).  Every metric but the
    maxima (``MISMATCH_MAXIMA``) is a mean over the valid tokens, so the metrics of a batch are the
    token-weighted sum of its parts' (and the largest of their maxima).
    """
    require_same_shape(rollout_logprobs=rollout_logprobs, train_logprobs=train_logprobs, mask=mask)
    valid = as_bool_mask(mask)
    lp_r = torch.where(valid, rollout_logprobs.detach().double(), 0.0)
    lp_t = torch.where(valid, train_logprobs.detach().double(), 0.0)
    d = lp_r - lp_t
    # exp(|d|) as 1 + expm1(|d|): exact for small d, and an empty mask gives 1.
    mult_err = 1.0 + masked_mean(torch.expm1(d.abs()), valid)
    prob_diff = (lp_r.exp() - lp_t.exp()).abs()
    return {
        "token_mult_prob_error": mult_err,
        "gen_kl": masked_mean(torch.expm1(-d) + d, valid),
        "policy_kl": masked_mean(torch.expm1(d) - d, valid),
        "js_divergence": masked_mean(bernoulli_js_divergence(lp_r, lp_t), valid),
        "rollout_probs_diff_max": masked_max(prob_diff, valid),
        "rollout_probs_diff_mean": masked_mean(prob_diff, valid),
    }
