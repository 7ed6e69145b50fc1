"""fp8rl.rl.policy_loss against a plain-Python PPO-clip reference, gradients and clip boundaries."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl.config import GRPOConfig
from fp8rl.rl import (
    DUAL_CLIP_YE_ET_AL,
    PolicyLossInput,
    grpo_advantages,
    policy_loss,
)

CL, CH = 0.2, 0.28


def ref_token_loss(ratio: float, adv: float, cl: float, ch: float, dual: float | None) -> float:
    """-min(r A, clip(r) A), capped at -c A for A < 0 under dual clip (Ye et al.)."""
    clipped = min(max(ratio, 1 - cl), 1 + ch)
    loss = -min(ratio * adv, clipped * adv)
    if dual is not None and adv < 0:
        loss = min(loss, -dual * adv)
    return loss


def ref_loss(
    lp: list[list[float]],
    old: list[list[float]],
    adv: list[float],
    mask: list[list[int]],
    cfg: GRPOConfig,
    w: list[list[float]] | None = None,
    ref: list[list[float]] | None = None,
) -> float:
    per_seq: list[list[float]] = []
    for i, row in enumerate(lp):
        losses = []
        for t, x in enumerate(row):
            if not mask[i][t]:
                continue
            tok = ref_token_loss(math.exp(x - old[i][t]), adv[i], cfg.clip_low, cfg.clip_high, cfg.dual_clip)
            tok *= w[i][t] if w else 1.0
            if ref:
                d = ref[i][t] - x
                tok += cfg.kl_coef * (math.exp(d) - d - 1)
            losses.append(tok)
        per_seq.append(losses)
    if cfg.loss_agg == "token-mean":
        flat = [x for s in per_seq for x in s]
        return sum(flat) / len(flat)
    means = [sum(s) / len(s) for s in per_seq if s]
    return sum(means) / len(means)


LP = [[-0.5, -1.2, -0.1, -2.0], [-0.3, -0.9, -4.0, -0.7], [-1.0, -0.2, -0.6, -0.05]]
OLD = [[-0.6, -0.8, -0.1, -2.5], [-0.35, -1.5, -3.0, -0.7], [-1.4, -0.25, -0.9, -0.3]]
ADV = [1.5, -0.8, 0.3]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
W = [[1.0, 0.5, 2.0, 9.0], [0.7, 1.0, 1.3, 1.1], [0.9, 0.0, 5.0, 5.0]]
REF = [[-0.4, -1.0, -0.3, -1.0], [-0.5, -0.9, -3.5, -0.2], [-1.1, -0.3, -0.5, -0.1]]


def make_input(with_w: bool = False, with_ref: bool = False, dtype: torch.dtype = torch.float64) -> PolicyLossInput:
    return PolicyLossInput(
        logprobs=torch.tensor(LP, dtype=dtype, requires_grad=True),
        old_logprobs=torch.tensor(OLD, dtype=dtype),
        advantages=torch.tensor(ADV, dtype=dtype),
        mask=torch.tensor(MASK, dtype=torch.float32),
        is_weights=torch.tensor(W, dtype=dtype) if with_w else None,
        ref_logprobs=torch.tensor(REF, dtype=dtype) if with_ref else None,
    )


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("dual_clip", [None, 1.4])
@pytest.mark.parametrize(("with_w", "with_ref"), [(False, False), (True, False), (True, True)])
def test_value_matches_reference(loss_agg: str, dual_clip: float | None, with_w: bool, with_ref: bool) -> None:
    cfg = GRPOConfig(clip_low=CL, clip_high=CH, dual_clip=dual_clip, loss_agg=loss_agg, kl_coef=0.1)  # type: ignore[arg-type]
    cfg = cfg if with_ref else GRPOConfig(clip_low=CL, clip_high=CH, dual_clip=dual_clip, loss_agg=loss_agg)  # type: ignore[arg-type]
    loss, metrics = policy_loss(make_input(with_w, with_ref), cfg)
    want = ref_loss(LP, OLD, ADV, MASK, cfg, W if with_w else None, REF if with_ref else None)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert metrics["loss"] == pytest.approx(want, rel=1e-12)


def test_metrics_match_hand_counts() -> None:
    _, m = policy_loss(make_input(with_ref=True), GRPOConfig(clip_low=CL, clip_high=CH, dual_clip=1.4))
    ratios, clip_low, clip_high, dual, kls = [], 0, 0, 0, []
    for i, row in enumerate(LP):
        for t, x in enumerate(row):
            if MASK[i][t]:
                r = math.exp(x - OLD[i][t])
                ratios.append(r)
                clip_low += ADV[i] < 0 and r < 1 - CL
                clip_high += ADV[i] > 0 and r > 1 + CH
                dual += ADV[i] < 0 and r > 1.4
                d = REF[i][t] - x
                kls.append(math.exp(d) - d - 1)
    n = len(ratios)
    assert clip_low and clip_high and dual  # the fixture exercises every branch
    assert m["ratio_mean"] == pytest.approx(sum(ratios) / n, rel=1e-12)
    assert m["ratio_max"] == pytest.approx(max(ratios), rel=1e-12)
    assert m["clip_frac_low"] == pytest.approx(clip_low / n)
    assert m["clip_frac_high"] == pytest.approx(clip_high / n)
    assert m["clip_frac_dual"] == pytest.approx(dual / n)
    assert m["kl_ref"] == pytest.approx(sum(kls) / n, rel=1e-12)
    assert m["pg_loss"] == m["loss"]  # kl_coef = 0: the KL is only reported
    assert all(isinstance(v, float) for v in m.values())


def test_masked_positions_get_exactly_zero_gradient_even_with_garbage() -> None:
    inp = make_input(with_w=True, with_ref=True)
    nan, inf = float("nan"), float("inf")
    pad = ~inp.mask.bool()
    lp = inp.logprobs.detach().masked_fill(pad, nan).requires_grad_()
    garbage = PolicyLossInput(
        logprobs=lp,
        old_logprobs=inp.old_logprobs.masked_fill(pad, -inf),
        advantages=inp.advantages[:, None].expand(3, 4).masked_fill(pad, nan),
        mask=inp.mask,
        is_weights=inp.is_weights.masked_fill(pad, inf),  # type: ignore[union-attr]
        ref_logprobs=inp.ref_logprobs.masked_fill(pad, nan),  # type: ignore[union-attr]
    )
    for agg in ("token-mean", "seq-mean-token-mean"):
        cfg = GRPOConfig(dual_clip=3.0, loss_agg=agg, kl_coef=0.05)
        lp.grad = None
        loss, metrics = policy_loss(garbage, cfg)
        loss.backward()
        assert lp.grad is not None
        assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())
        assert (lp.grad[pad] == 0).all()
        assert (lp.grad[~pad] != 0).any()
        # the same as with clean padding
        clean, _ = policy_loss(make_input(True, True), cfg)
        assert loss.item() == pytest.approx(clean.item(), rel=1e-12)


def test_gradient_at_ratio_one_is_advantage_over_token_count() -> None:
    # ratio = 1 and no clipping: d loss / d lp_it = -A_i * m_it / sum(m)
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    inp = PolicyLossInput(lp, lp.detach(), torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK))
    loss, _ = policy_loss(inp, GRPOConfig())
    loss.backward()
    n = sum(map(sum, MASK))
    want = [[-ADV[i] * MASK[i][t] / n for t in range(4)] for i in range(3)]
    assert loss.item() == pytest.approx(-sum(ADV[i] * sum(MASK[i]) for i in range(3)) / n)
    assert torch.equal(lp.grad, torch.tensor(want, dtype=torch.float64))  # type: ignore[arg-type]
    # seq-mean-token-mean: -A_i * m_it / (len_i * number of sequences)
    lp.grad = None
    loss, _ = policy_loss(inp, GRPOConfig(loss_agg="seq-mean-token-mean"))
    loss.backward()
    want = [[-ADV[i] * MASK[i][t] / (sum(MASK[i]) * 3) for t in range(4)] for i in range(3)]
    assert torch.allclose(lp.grad, torch.tensor(want, dtype=torch.float64), rtol=1e-14, atol=0)  # type: ignore[arg-type]


def one_token(ratio: float, adv: float, cfg: GRPOConfig) -> tuple[float, float, dict[str, float]]:
    """Loss, d loss / d lp and metrics for a single valid token with the given ratio."""
    lp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0 - math.log(ratio)]], dtype=torch.float64)
    loss, metrics = policy_loss(
        PolicyLossInput(lp, old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1)), cfg
    )
    loss.backward()
    return loss.item(), lp.grad.item(), metrics  # type: ignore[union-attr]


D = 1e-3


@pytest.mark.parametrize(
    ("ratio", "adv", "clipped", "key"),
    [
        (1 + CH - D, 1.0, False, "clip_frac_high"),  # A > 0: inside the upper bound, still learning
        (1 + CH + D, 1.0, True, "clip_frac_high"),  # A > 0: beyond it, no gradient
        (1 - CL - D, 1.0, False, "clip_frac_low"),  # A > 0: below 1 - clip_low the unclipped term is the min
        (1 - CL + D, -1.0, False, "clip_frac_low"),  # A < 0: inside the lower bound
        (1 - CL - D, -1.0, True, "clip_frac_low"),  # A < 0: beyond it, no gradient
        (1 + CH + D, -1.0, False, "clip_frac_high"),  # A < 0: above 1 + clip_high the unclipped term is the max
    ],
)
def test_clip_boundaries(ratio: float, adv: float, clipped: bool, key: str) -> None:
    loss, grad, metrics = one_token(ratio, adv, GRPOConfig(clip_low=CL, clip_high=CH))
    assert loss == pytest.approx(ref_token_loss(ratio, adv, CL, CH, None), rel=1e-12)
    if clipped:
        assert grad == 0.0
        assert metrics[key] == 1.0
    else:
        assert grad == pytest.approx(-adv * ratio, rel=1e-12)  # d(-r A)/d lp = -A r
        assert metrics[key] == 0.0


def test_dual_clip_caps_negative_advantage_loss() -> None:
    cfg = GRPOConfig(dual_clip=DUAL_CLIP_YE_ET_AL)
    loss, grad, m = one_token(3.5, -2.0, cfg)
    assert (loss, grad, m["clip_frac_dual"]) == (pytest.approx(6.0), 0.0, 1.0)  # -c A = 3 * 2
    loss, grad, m = one_token(2.5, -2.0, cfg)
    assert (loss, grad, m["clip_frac_dual"]) == (pytest.approx(5.0), pytest.approx(5.0), 0.0)
    loss, grad, m = one_token(3.5, -2.0, GRPOConfig())  # off: unbounded
    assert (loss, grad, "clip_frac_dual" in m) == (pytest.approx(7.0), pytest.approx(7.0), False)
    loss, _, _ = one_token(3.5, 2.0, cfg)  # A > 0 is untouched by dual clip
    assert loss == pytest.approx(-2.0 * (1 + 0.28))


def test_aggregation_modes_on_unequal_lengths() -> None:
    # ratio 1, so the per-token loss is -A: sequence 0 has 1 token with A = 4, sequence 1 has 3 with A = 1
    lp = torch.zeros(2, 3, requires_grad=True)
    inp = PolicyLossInput(lp, lp.detach(), torch.tensor([4.0, 1.0]), torch.tensor([[1, 0, 0], [1, 1, 1]]))
    token_mean, _ = policy_loss(inp, GRPOConfig(loss_agg="token-mean"))
    seq_mean, _ = policy_loss(inp, GRPOConfig(loss_agg="seq-mean-token-mean"))
    assert token_mean.item() == pytest.approx(-(4 + 3) / 4)
    assert seq_mean.item() == pytest.approx(-(4 + 1) / 2)
    # equal lengths: the two agree
    equal = PolicyLossInput(lp, lp.detach(), torch.tensor([4.0, 1.0]), torch.ones(2, 3))
    a, _ = policy_loss(equal, GRPOConfig(loss_agg="token-mean"))
    b, _ = policy_loss(equal, GRPOConfig(loss_agg="seq-mean-token-mean"))
    assert a.item() == pytest.approx(b.item())


def test_empty_sequences_are_skipped_and_empty_batch_is_zero() -> None:
    lp = torch.zeros(3, 2, requires_grad=True)
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]])
    inp = PolicyLossInput(lp, lp.detach(), torch.tensor([1.0, 100.0, 3.0]), mask)
    loss, _ = policy_loss(inp, GRPOConfig(loss_agg="seq-mean-token-mean"))
    assert loss.item() == pytest.approx(-(1 + 3) / 2)
    for agg in ("token-mean", "seq-mean-token-mean"):
        lp.grad = None
        empty = PolicyLossInput(lp, lp.detach(), torch.ones(3), torch.zeros(3, 2, dtype=torch.bool))
        loss, metrics = policy_loss(empty, GRPOConfig(loss_agg=agg))
        loss.backward()
        assert loss.item() == 0.0 and metrics["ratio_max"] == 0.0
        assert lp.grad is not None and not lp.grad.any()


def test_is_weights_scale_the_gradient_and_are_detached() -> None:
    lp = torch.zeros(1, 2, requires_grad=True)
    w = torch.tensor([[0.5, 2.0]], requires_grad=True)
    loss, _ = policy_loss(PolicyLossInput(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2), w), GRPOConfig())
    loss.backward()
    assert lp.grad.tolist() == [[-0.25, -1.0]]  # type: ignore[union-attr]
    assert w.grad is None


def test_kl_penalty_gradient() -> None:
    # d/d lp [exp(ref - lp) - (ref - lp) - 1] = 1 - exp(ref - lp); ratio = 1 and A = 0 isolate it
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    inp = PolicyLossInput(lp, lp.detach(), torch.zeros(1, dtype=torch.float64), torch.ones(1, 2), ref_logprobs=ref)
    loss, m = policy_loss(inp, GRPOConfig(kl_coef=0.5))
    loss.backward()
    want = [0.5 * (1 - math.exp(r - x)) / 2 for x, r in ((-1.0, -1.5), (-2.0, -1.0))]
    assert lp.grad.tolist()[0] == pytest.approx(want, rel=1e-12)  # type: ignore[union-attr]
    assert m["pg_loss"] == 0.0 and m["loss"] == pytest.approx(0.5 * m["kl_ref"])


def test_grpo_is_this_loss_with_group_advantages() -> None:
    # one prompt, four samples: the rewarded ones' log-probs are pushed up, the others down
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4)
    lp = torch.full((4, 3), -1.0, requires_grad=True)
    loss, _ = policy_loss(
        PolicyLossInput(lp, lp.detach(), adv, torch.ones(4, 3)), GRPOConfig(clip_low=0.2, clip_high=0.2)
    )
    loss.backward()
    grad = lp.grad
    assert grad is not None
    assert (grad[[0, 2]] < 0).all() and (grad[[1, 3]] > 0).all()  # descent raises lp where grad < 0


def test_bf16_inputs_compute_in_float32() -> None:
    inp = make_input(with_w=True, with_ref=True, dtype=torch.bfloat16)
    loss, _ = policy_loss(inp, GRPOConfig(kl_coef=0.1))
    loss.backward()
    assert loss.dtype == torch.float32
    assert inp.logprobs.grad is not None and inp.logprobs.grad.dtype == torch.bfloat16


def test_extreme_log_ratio_stays_finite() -> None:
    lp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-500.0, -1.0]])
    loss, m = policy_loss(PolicyLossInput(lp, old, torch.tensor([-1.0]), torch.ones(1, 2)), GRPOConfig())
    loss.backward()
    assert math.isfinite(loss.item()) and math.isfinite(m["ratio_max"])
    assert torch.isfinite(lp.grad).all()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"loss_agg": "seq-sum"}, "loss_agg"),
        ({"kl_coef": -1.0}, "kl_coef"),
    ],
)
def test_config_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**kwargs)  # type: ignore[arg-type]


def test_input_validation() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="share one"):
        PolicyLossInput(x, torch.zeros(2, 4), torch.zeros(2), x)
    with pytest.raises(ValueError, match="advantages"):
        PolicyLossInput(x, x, torch.zeros(3), x)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(PolicyLossInput(x, x, torch.zeros(2), x), GRPOConfig(kl_coef=0.1))
