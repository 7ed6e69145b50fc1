"""The k-th smallest value behind the FP8 KV-cache calibration's quantile: both ways of taking it agree; non-finite
activations are an error."""

from __future__ import annotations

import pytest
import torch

from fp8rl.rollout import kv_calibration
from fp8rl.rollout.kv_calibration import high_quantile, kth_smallest


@pytest.mark.parametrize("n", [1, 7, 1000, 12345])
def test_topk_and_kthvalue_give_the_same_order_statistic(n: int) -> None:
    torch.manual_seed(n)
    flat = torch.randn(n).abs().round(decimals=1)  # many ties
    for k in {1, max(1, n // 2), max(1, n - 3), n}:
        by_topk = float(torch.topk(flat, n - k + 1, sorted=False).values.min())
        assert by_topk == kth_smallest(flat, k) == float(flat.sort().values[k - 1])


def test_high_quantile_is_the_ceil_q_n_th_smallest(monkeypatch: pytest.MonkeyPatch) -> None:
    values = torch.arange(1, 1001, dtype=torch.float32)[torch.randperm(1000)]
    assert high_quantile(values, 0.999) == 999.0
    assert high_quantile(values, 1.0) == 1000.0
    monkeypatch.setattr(kv_calibration, "_SAMPLE_LIMIT", 100)  # past the limit: an even sample
    assert high_quantile(torch.arange(1, 1001, dtype=torch.float32), 0.5) == 491.0


def test_non_finite_activations_are_an_error_naming_the_layer() -> None:
    """A diverged policy (NaN weights) gives no scales: an error naming where, not a NaN (or silently old) scale."""
    from fp8rl.models import make_tiny_model
    from fp8rl.rollout.kv_calibration import calibrate_kv_scales

    torch.manual_seed(0)
    model, _ = make_tiny_model("small", dtype=torch.float32)
    ids = torch.randint(3, 100, (2, 12))
    mask, pos = torch.ones_like(ids), torch.arange(12).expand(2, 12)
    assert calibrate_kv_scales(model, ids, mask, pos)[2].v > 0
    with torch.no_grad():
        model.model.layers[2].self_attn.v_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite activations in layer 2 v.*diverged"):
        calibrate_kv_scales(model, ids, mask, pos)
