"""fp8rl.rl mismatch metrics and masked reductions against plain-Python float references."""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8rl.rl import bernoulli_js_divergence, kl_k3, masked_max, masked_mean, masked_sum, mismatch_metrics

ROLL = [[-0.1, -2.0, -0.7, -9.0], [0.0, -1e-4, -5.0, -0.3]]
TRAIN = [[-0.12, -1.5, -0.7, -1.0], [-0.01, -3e-4, -4.0, -0.3]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1]]


def js_reference(lp_a: float, lp_b: float) -> float:
    """1/2 KL(P || M) + 1/2 KL(Q || M) of the Bernoulli pairs, in the KL form, 0 log 0 = 0."""
    p, q = math.exp(lp_a), math.exp(lp_b)
    pc, qc = -math.expm1(lp_a), -math.expm1(lp_b)
    mid, midc = (p + q) / 2, (pc + qc) / 2

    def kl(x: float, xc: float) -> float:
        return (x * math.log(x / mid) if x > 0 else 0.0) + (xc * math.log(xc / midc) if xc > 0 else 0.0)

    return 0.5 * kl(p, pc) + 0.5 * kl(q, qc)


def reference(roll: list[list[float]], train: list[list[float]], mask: list[list[int]]) -> dict[str, float]:
    pairs = [
        (r, t) for rr, tr, mr in zip(roll, train, mask, strict=True) for r, t, m in zip(rr, tr, mr, strict=True) if m
    ]
    ds = [r - t for r, t in pairs]
    diffs = [abs(math.exp(r) - math.exp(t)) for r, t in pairs]
    n = len(pairs)
    return {
        "token_mult_prob_error": sum(math.exp(abs(d)) for d in ds) / n,
        "gen_kl": sum(math.exp(-d) + d - 1 for d in ds) / n,
        "policy_kl": sum(math.exp(d) - d - 1 for d in ds) / n,
        "js_divergence": sum(js_reference(r, t) for r, t in pairs) / n,
        "rollout_probs_diff_max": max(diffs),
        "rollout_probs_diff_mean": sum(diffs) / n,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_reference(dtype: torch.dtype) -> None:
    got = mismatch_metrics(torch.tensor(ROLL, dtype=dtype), torch.tensor(TRAIN, dtype=dtype), torch.tensor(MASK))
    # float32 inputs are exact float32 values of the decimals; the reference reads the same values
    roll = torch.tensor(ROLL, dtype=dtype).double().tolist()
    train = torch.tensor(TRAIN, dtype=dtype).double().tolist()
    want = reference(roll, train, MASK)
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-15), key


def test_identical_logprobs_are_exactly_neutral() -> None:
    lp = torch.tensor(ROLL)
    got = mismatch_metrics(lp, lp.clone(), torch.tensor(MASK, dtype=torch.bool))
    assert got == {
        "token_mult_prob_error": 1.0,
        "gen_kl": 0.0,
        "policy_kl": 0.0,
        "js_divergence": 0.0,
        "rollout_probs_diff_max": 0.0,
        "rollout_probs_diff_mean": 0.0,
    }


def test_masked_tokens_do_not_count() -> None:
    roll = torch.tensor(ROLL)
    roll[0, 3] = float("nan")  # a padded position may hold anything
    base = mismatch_metrics(torch.tensor(ROLL), torch.tensor(TRAIN), torch.tensor(MASK))
    assert mismatch_metrics(roll, torch.tensor(TRAIN), torch.tensor(MASK, dtype=torch.float32)) == base
    empty = mismatch_metrics(roll, torch.tensor(TRAIN), torch.zeros(2, 4))
    assert empty["token_mult_prob_error"] == 1.0 and empty["gen_kl"] == 0.0 and empty["rollout_probs_diff_max"] == 0.0


def test_js_divergence_edge_cases() -> None:
    lp = torch.tensor([0.0, 0.0, -1e-9, -50.0, -0.5], dtype=torch.float64)
    other = torch.tensor([0.0, -50.0, -2e-9, -50.0, -1.5], dtype=torch.float64)
    js = bernoulli_js_divergence(lp, other)
    assert torch.isfinite(js).all()
    assert js[0] == 0.0  # p = q = 1: no 0/0
    assert js[1].item() == pytest.approx(math.log(2), rel=1e-12)  # certain vs (almost) impossible: the maximum
    assert js[2:].tolist() == pytest.approx(
        [js_reference(a, b) for a, b in zip(lp[2:].tolist(), other[2:].tolist(), strict=True)], rel=1e-6, abs=1e-30
    )
    assert torch.equal(js, bernoulli_js_divergence(other, lp))  # symmetric
    # an engine's log-prob a rounding error above 0 is read as probability 1
    assert bernoulli_js_divergence(torch.tensor([1e-7]), torch.tensor([0.0])).item() == 0.0


def test_kl_k3() -> None:
    lp = torch.tensor([[-1.0, -0.2, -3.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.0, -0.7, -1.0]], dtype=torch.float64)
    want = [math.exp(r - x) - (r - x) - 1 for x, r in ((-1.0, -1.0), (-0.2, -0.7), (-3.0, -1.0))]
    assert kl_k3(lp, ref).tolist()[0] == pytest.approx(want, rel=1e-12)
    assert kl_k3(lp, ref)[0, 0] == 0.0


def test_masked_reductions() -> None:
    x = torch.tensor([[1.0, float("nan"), 3.0], [-4.0, -2.0, float("inf")]], requires_grad=True)
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    assert masked_sum(x, mask).item() == -2.0
    assert masked_mean(x, mask).item() == -0.5
    assert masked_mean(x, mask, dim=1).tolist() == [2.0, -3.0]
    assert masked_mean(x, mask, dim=0).tolist() == [-1.5, -2.0, 3.0]
    assert masked_max(x, mask).item() == 3.0
    assert masked_max(x, torch.tensor([[0, 0, 0], [1, 1, 0]])).item() == -2.0  # all negative
    assert masked_max(x, torch.zeros(2, 3)).item() == 0.0
    assert masked_mean(x, torch.zeros(2, 3)).item() == 0.0  # empty: 0, not NaN
    masked_mean(x, mask).backward()
    assert x.grad is not None and x.grad.tolist() == [[0.25, 0.0, 0.25], [0.25, 0.25, 0.0]]


logprobs = hnp.arrays(np.float64, (2, 6), elements=st.floats(-30.0, 0.0))


@settings(max_examples=100, deadline=None)
@given(roll=logprobs, train=logprobs, mask=hnp.arrays(np.bool_, (2, 6)))
def test_properties(roll: np.ndarray, train: np.ndarray, mask: np.ndarray) -> None:
    m = mismatch_metrics(torch.from_numpy(roll), torch.from_numpy(train), torch.from_numpy(mask))
    assert all(math.isfinite(v) for v in m.values())
    assert m["token_mult_prob_error"] >= 1.0
    assert m["gen_kl"] >= 0.0 and m["policy_kl"] >= 0.0
    assert 0.0 <= m["js_divergence"] <= math.log(2) + 1e-12
    # the mean of equal values can exceed their max by an ulp of float summation
    assert 0.0 <= m["rollout_probs_diff_mean"] <= m["rollout_probs_diff_max"] * (1 + 1e-12) <= 1.0 + 1e-12
    swapped = mismatch_metrics(torch.from_numpy(train), torch.from_numpy(roll), torch.from_numpy(mask))
    # exchanging the engines swaps the two KLs and leaves the symmetric metrics alone
    assert swapped["gen_kl"] == pytest.approx(m["policy_kl"], rel=1e-9, abs=1e-12)
    assert swapped["js_divergence"] == pytest.approx(m["js_divergence"], rel=1e-9, abs=1e-15)
    assert swapped["token_mult_prob_error"] == pytest.approx(m["token_mult_prob_error"], rel=1e-12)
