"""fp8rl.rl.mismatch_correction (TIS / MIS, token / sequence) against plain-Python references."""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from fp8rl.config import Correction, MISCorrection, NoCorrection, TISCorrection
from fp8rl.rl import mismatch_correction

# log rho = TRAIN - ROLL on valid tokens: [0.1, 0.7, -0.05], [-0.2, 0.1, 0, -0.3], [0.3, 0.3, 0.3]
# sequence products: exp(0.75) = 2.12, exp(-0.4) = 0.67, exp(0.9) = 2.46
TRAIN = [[-0.5, -1.0, -0.2, -3.0], [-1.1, -2.0, -0.4, -0.9], [-1.0, -1.0, -1.0, -1.0]]
ROLL = [[-0.6, -1.7, -0.15, -0.1], [-0.9, -2.1, -0.4, -0.6], [-1.3, -1.3, -1.3, -1.3]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0]]


def log_rho(i: int, t: int) -> float:
    return TRAIN[i][t] - ROLL[i][t]


def seq_log_rho(i: int) -> float:
    return sum(log_rho(i, t) for t in range(4) if MASK[i][t])


def ess(ws: list[float]) -> float:
    return sum(ws) ** 2 / (len(ws) * sum(w * w for w in ws))


def correction(type_: str, level: str = "token", threshold: float = 2.0) -> Correction:
    """The recipe's correction ``type_`` at ``level`` ("none" has no level; only "tis" a threshold)."""
    if type_ == "none":
        return NoCorrection()
    fields = {"type": type_, "level": level} | ({"threshold": threshold} if type_ == "tis" else {})
    return TypeAdapter(Correction).validate_python(fields)


def run(cfg: Correction, mask_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, dict]:
    train = torch.tensor(TRAIN, dtype=torch.float64)
    roll = torch.tensor(ROLL, dtype=torch.float64)
    return mismatch_correction(train, roll, torch.tensor(MASK, dtype=mask_dtype), cfg)


@pytest.mark.parametrize("type_", ["none", "tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_identical_logprobs_are_neutral(type_: str, level: str) -> None:
    lp = torch.tensor(TRAIN)
    mask = torch.tensor(MASK, dtype=torch.float32)
    w, new_mask, m = mismatch_correction(lp, lp.clone(), mask, correction(type_, level))
    assert torch.equal(w, mask) and torch.equal(new_mask, mask)
    assert m["is_weight_mean"] == 1.0 and m["is_weight_max"] == 1.0 and m["is_ess"] == 1.0
    assert m.get("frac_clipped", 0.0) == 0.0 and m.get("frac_masked", 0.0) == 0.0


def test_none_passes_the_mask_through() -> None:
    w, new_mask, m = run(NoCorrection())
    assert torch.equal(w, torch.tensor(MASK, dtype=torch.float64))
    assert torch.equal(new_mask, torch.tensor(MASK, dtype=torch.float32))
    assert set(m) == {"is_weight_mean", "is_weight_max", "is_ess"}


def test_tis_token_truncates_at_threshold() -> None:
    c = 1.2
    w, new_mask, m = run(TISCorrection(level="token", threshold=c))
    want = [[min(math.exp(log_rho(i, t)), c) if MASK[i][t] else 0.0 for t in range(4)] for i in range(3)]
    assert w.tolist() == [pytest.approx(row, rel=1e-12) for row in want]
    assert torch.equal(new_mask, torch.tensor(MASK, dtype=torch.float32))
    valid = [want[i][t] for i in range(3) for t in range(4) if MASK[i][t]]
    clipped = sum(math.exp(log_rho(i, t)) > c for i in range(3) for t in range(4) if MASK[i][t])
    assert clipped == 4  # rho = exp(0.7) and the three exp(0.3)
    assert m["frac_clipped"] == pytest.approx(clipped / len(valid))
    assert m["is_weight_mean"] == pytest.approx(sum(valid) / len(valid), rel=1e-12)
    assert m["is_weight_max"] == pytest.approx(max(valid), rel=1e-12)
    assert m["is_ess"] == pytest.approx(ess(valid), rel=1e-12)


def test_tis_sequence_uses_the_product_of_ratios() -> None:
    c = 2.3
    w, _, m = run(TISCorrection(level="sequence", threshold=c))
    seq_w = [min(math.prod(math.exp(log_rho(i, t)) for t in range(4) if MASK[i][t]), c) for i in range(3)]
    assert 1 < seq_w[0] < c and seq_w[1] < 1 and seq_w[2] == c  # in between, below 1, truncated
    want = [[seq_w[i] * MASK[i][t] for t in range(4)] for i in range(3)]
    assert w.tolist() == [pytest.approx(row, rel=1e-12) for row in want]
    valid = [want[i][t] for i in range(3) for t in range(4) if MASK[i][t]]
    assert m["frac_clipped"] == pytest.approx(3 / 10)  # the 3 tokens of sequence 2
    assert m["is_ess"] == pytest.approx(ess(valid), rel=1e-12)


def test_tis_sequence_does_not_overflow() -> None:
    # 1000 tokens with log rho = 0.5 each: the product is exp(500), beyond float32 and float64
    train = torch.zeros(2, 1000)
    roll = torch.full((2, 1000), -0.5)
    roll[1] = 0.5  # the other sequence underflows: exp(-500)
    w, _, m = mismatch_correction(train, roll, torch.ones(2, 1000), TISCorrection(level="sequence", threshold=2.0))
    assert torch.isfinite(w).all()
    assert (w[0] == 2.0).all() and (w[1] == 0.0).all()
    assert m["frac_clipped"] == 0.5 and 0.0 < m["is_ess"] <= 1.0


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_mis_token_masks_ratios_outside_the_window(mask_dtype: torch.dtype) -> None:
    low, high = 0.8, 1.25
    w, new_mask, m = run(MISCorrection(level="token", low=low, high=high), mask_dtype)
    keep = [[bool(MASK[i][t]) and low <= math.exp(log_rho(i, t)) <= high for t in range(4)] for i in range(3)]
    assert new_mask.dtype == mask_dtype
    assert new_mask.bool().tolist() == keep
    assert w.tolist() == [[float(k) for k in row] for row in keep]
    n_valid = sum(map(sum, MASK))
    n_keep = sum(map(sum, keep))
    assert 0 < n_keep < n_valid
    assert m["frac_masked"] == pytest.approx(1 - n_keep / n_valid)
    assert m["is_ess"] == pytest.approx(n_keep / n_valid)  # dropped tokens count as weight 0


def test_mis_sequence_masks_whole_sequences() -> None:
    # every token of sequence 2 has rho = exp(0.3) = 1.35, inside [0.5, 2]; their product exp(0.9) = 2.46 is not
    low, high = 0.5, 2.0
    token_w, _, _ = run(MISCorrection(level="token", low=low, high=high))
    seq_w, new_mask, m = run(MISCorrection(level="sequence", low=low, high=high))
    assert token_w[2].tolist() == [1.0, 1.0, 1.0, 0.0]
    keep_seq = [low <= math.exp(seq_log_rho(i)) <= high for i in range(3)]
    assert keep_seq == [False, True, False]  # 2.12 and 2.46 leave the window
    want = [[float(keep_seq[i] and MASK[i][t]) for t in range(4)] for i in range(3)]
    assert seq_w.tolist() == want and new_mask.tolist() == want
    assert m["frac_masked"] == pytest.approx(6 / 10)


def test_mis_window_boundaries() -> None:
    train = torch.zeros(1, 4, dtype=torch.float64)
    rho = torch.tensor([[0.5 * (1 - 1e-6), 0.5 * (1 + 1e-6), 2.0 * (1 - 1e-6), 2.0 * (1 + 1e-6)]], dtype=torch.float64)
    _, new_mask, _ = mismatch_correction(train, -rho.log(), torch.ones(1, 4), MISCorrection())
    assert new_mask.tolist() == [[0.0, 1.0, 1.0, 0.0]]


def test_garbage_in_padding_is_ignored_and_weights_are_detached() -> None:
    train = torch.tensor(TRAIN, requires_grad=True)
    pad = ~torch.tensor(MASK, dtype=torch.bool)
    roll = torch.tensor(ROLL).masked_fill(pad, float("nan"))
    for cfg in (TISCorrection(level="sequence"), MISCorrection(level="token"), TISCorrection()):
        w, _, m = mismatch_correction(train, roll, torch.tensor(MASK), cfg)
        assert not w.requires_grad
        assert (w[pad] == 0).all() and torch.isfinite(w).all()
        assert all(math.isfinite(v) for v in m.values())


def test_everything_masked() -> None:
    _, _, m = mismatch_correction(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), TISCorrection())
    assert m == {"is_weight_mean": 0.0, "is_weight_max": 0.0, "is_ess": 1.0, "frac_clipped": 0.0}
    _, new_mask, m = mismatch_correction(torch.zeros(1, 2), torch.full((1, 2), -5.0), torch.ones(1, 2), MISCorrection())
    assert new_mask.sum() == 0 and m["is_ess"] == 0.0 and m["frac_masked"] == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"type": "is"}, "type"),
        ({"type": "tis", "level": "geometric"}, "level"),
        ({"type": "tis", "threshold": 0.0}, "threshold"),
        ({"type": "mis", "low": 1.5}, "low"),
        ({"type": "mis", "high": 0.9}, "high"),
    ],
)
def test_config_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TypeAdapter(Correction).validate_python(kwargs)


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="share one"):
        mismatch_correction(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), NoCorrection())


logprob_arrays = hnp.arrays(np.float32, (3, 5), elements=st.floats(-15.0, 0.0, width=32))


@settings(max_examples=60, deadline=None)
@given(
    train=logprob_arrays,
    roll=logprob_arrays,
    mask=hnp.arrays(np.bool_, (3, 5)),
    type_=st.sampled_from(["none", "tis", "mis"]),
    level=st.sampled_from(["token", "sequence"]),
    threshold=st.floats(1.0, 10.0, exclude_min=True),  # TISCorrection: threshold > 1
)
def test_properties(
    train: np.ndarray, roll: np.ndarray, mask: np.ndarray, type_: str, level: str, threshold: float
) -> None:
    cfg = correction(type_, level, threshold)
    w, new_mask, m = mismatch_correction(torch.from_numpy(train), torch.from_numpy(roll), torch.from_numpy(mask), cfg)
    assert torch.isfinite(w).all() and (w >= 0).all()
    assert (w[~new_mask] == 0).all()
    assert not (new_mask & ~torch.from_numpy(mask)).any()  # the mask only ever shrinks
    assert 0.0 <= m["is_ess"] <= 1.0
    if type_ == "tis":
        assert (w <= threshold * (1 + 1e-6)).all()
        if level == "token" or mask.any():
            assert m["is_ess"] > 0.0  # truncated weights are positive: ess in (0, 1]
    if type_ == "none" and mask.any():
        assert m["is_ess"] == 1.0
