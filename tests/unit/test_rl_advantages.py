"""fp8rl.rl.grpo_advantages against plain-Python references of GRPO, Dr. GRPO and RLOO."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8rl.rl import grpo_advantages

REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 2.0, -1.0, 0.0, 3.0, 3.0, 3.0, 3.0]  # 3 groups of 4, the last constant


def reference(rewards: list[float], g: int, std_normalize: bool, leave_one_out: bool, eps: float) -> list[float]:
    out: list[float] = []
    for start in range(0, len(rewards), g):
        group = rewards[start : start + g]
        if len(set(group)) == 1:
            out += [0.0] * g
            continue
        mean = sum(group) / g
        std = statistics.stdev(group)  # Bessel-corrected, the documented choice
        for r in group:
            baseline = (sum(group) - r) / (g - 1) if leave_one_out else mean
            a = r - baseline
            out.append(a / (std + eps) if std_normalize else a)
    return out


@pytest.mark.parametrize("std_normalize", [True, False])
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_matches_reference(std_normalize: bool, leave_one_out: bool) -> None:
    got = grpo_advantages(torch.tensor(REWARDS, dtype=torch.float64), 4, std_normalize, leave_one_out, eps=1e-6)
    want = reference(REWARDS, 4, std_normalize, leave_one_out, 1e-6)
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_hand_computed_group() -> None:
    # rewards [1, 0, 0, 1]: mean 0.5, Bessel std sqrt(1/3)
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, eps=0.0)
    s = 0.5 / math.sqrt(1 / 3)
    assert adv.tolist() == pytest.approx([s, -s, -s, s], rel=1e-6)
    # RLOO: 1 - mean(0, 0, 1) = 2/3 and 0 - mean(1, 0, 1) = -2/3
    loo = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, std_normalize=False, leave_one_out=True)
    assert loo.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], rel=1e-6)


def test_dr_grpo_is_reward_minus_group_mean() -> None:
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 10.0, 20.0]), 2, std_normalize=False)
    assert adv.tolist() == [1.0, -1.0, -5.0, 5.0]


def test_group_properties() -> None:
    torch.manual_seed(0)
    rewards = torch.randn(64, dtype=torch.float64)
    adv = grpo_advantages(rewards, 8).view(8, 8)
    assert adv.mean(dim=1).abs().max() < 1e-12
    assert torch.allclose(adv.std(dim=1), torch.ones(8, dtype=torch.float64), atol=1e-5)  # 1 - eps / std
    centered = grpo_advantages(rewards, 8, std_normalize=False).view(8, 8)
    assert centered.mean(dim=1).abs().max() < 1e-12


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, -7.3, 1e6])
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_constant_groups_give_exact_zeros(value: float, leave_one_out: bool) -> None:
    # 0.1 * 3 is not exactly representable: r - mean leaves a rounding residue that
    # eps = 1e-6 would amplify; the constant group must still be exactly zero.
    rewards = torch.full((6,), value, dtype=torch.float32)
    adv = grpo_advantages(rewards, 3, leave_one_out=leave_one_out)
    assert not adv.isnan().any()
    assert adv.tolist() == [0.0] * 6


def test_group_of_one_is_zero_and_dtypes() -> None:
    assert grpo_advantages(torch.tensor([1.0, 5.0]), 1).tolist() == [0.0, 0.0]
    assert grpo_advantages(torch.tensor([1, 0, 1, 1]), 2).dtype == torch.float32  # integer rewards
    assert grpo_advantages(torch.tensor([True, False]), 2).dtype == torch.float32


def test_detached_from_rewards() -> None:
    rewards = torch.tensor([1.0, 2.0], requires_grad=True)
    assert not grpo_advantages(rewards, 2).requires_grad


@pytest.mark.parametrize(
    ("n", "group_size", "leave_one_out", "match"),
    [
        (6, 4, False, "do not split into groups of 4"),
        (4, 0, False, "group_size must be >= 1"),
        (4, 1, True, "leave_one_out needs group_size >= 2"),
    ],
)
def test_errors(n: int, group_size: int, leave_one_out: bool, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        grpo_advantages(torch.zeros(n), group_size, leave_one_out=leave_one_out)


def test_rejects_2d_rewards() -> None:
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 4), 4)


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(
        st.lists(st.floats(-100, 100, allow_nan=False), min_size=4, max_size=4),
        min_size=1,
        max_size=5,
    ),
    leave_one_out=st.booleans(),
    std_normalize=st.booleans(),
)
def test_properties(groups: list[list[float]], leave_one_out: bool, std_normalize: bool) -> None:
    flat = [r for g in groups for r in g]
    adv = grpo_advantages(torch.tensor(flat, dtype=torch.float64), 4, std_normalize, leave_one_out).view(-1, 4)
    assert torch.isfinite(adv).all()
    for g, a in zip(groups, adv.tolist(), strict=True):
        assert abs(sum(a)) <= 1e-9 * (1 + max(abs(x) for x in a))  # zero mean per group
        for i in range(4):  # the order of rewards is the order of advantages
            for j in range(4):
                if g[i] > g[j]:
                    assert a[i] >= a[j]
