"""``rollout.kv_calibration_tokens``: the FP8 KV-cache recalibration on a token budget of evenly spaced rows of
the step's batch instead of the whole batch (its forward is a cost of every step)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8rl.build import build_parts, task_examples
from fp8rl.config import RunConfig, load_recipe
from fp8rl.loop import rl_step
from fp8rl.rollout.kv_calibration import calibrate_kv_scales, calibration_rows
from fp8rl.train.trainer import build_batch


def test_rows_are_every_kth_within_the_budget() -> None:
    mask = torch.ones(12, 10)  # 120 valid tokens
    assert calibration_rows(mask, None) == slice(None)
    assert calibration_rows(mask, 500) == slice(None, None, 1)  # fits: every row
    rows = calibration_rows(mask, 40)
    assert rows == slice(None, None, 3) and int(mask[rows].sum()) <= 40
    assert calibration_rows(mask, 1) == slice(None, None, 120)  # one row at least
    with pytest.raises(ValueError, match="kv_calibration_tokens"):
        RunConfig.model_validate({"recipe": load_recipe("bf16"), "rollout": {"kv_calibration_tokens": 0}})


def test_scales_from_a_quarter_of_the_rows_stay_close_to_the_whole_batch(tiny_models: dict[str, Path]) -> None:
    from fp8rl.models.loading import load_causal_lm

    model = load_causal_lm(tiny_models["small"], dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (6,), generator=g).tolist() for _ in range(32)]
    batch = build_batch(prompts, torch.randint(3, 90, (32, 40), generator=g), torch.ones(32, 40), pad_id=0)
    full = calibrate_kv_scales(model, batch.input_ids, batch.attention_mask, batch.position_ids)
    rows = calibration_rows(batch.attention_mask, int(batch.attention_mask.sum()) // 4)
    part = calibrate_kv_scales(model, batch.input_ids[rows], batch.attention_mask[rows], batch.position_ids[rows])
    assert rows.step == 4 and full.keys() == part.keys()
    worst = max(abs(getattr(part[i], c) / getattr(full[i], c) - 1) for i in full for c in "qkv")
    print(f"quarter of the rows vs all: max relative scale difference {worst:.3g}")
    assert worst < 0.1


def test_the_step_calibrates_on_the_budget_and_reports_it(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    cfg = RunConfig.model_validate({
        "recipe": load_recipe("fp8-e2e"), "grpo": {"prompts_per_step": 4, "group_size": 4},
        "sampling": {"max_tokens": 8}, "rollout": {"kv_calibration_tokens": 60}, "work_dir": str(tmp_path),
    })  # fmt: skip
    parts = build_parts(cfg, tiny_models["tiny"], "cpu")
    seen: list[int] = []

    def calibrate(batch: object) -> dict[str, float]:  # what an FP8 KV-cache engine is handed
        seen.append(int(batch.attention_mask.sum()))  # type: ignore[attr-defined]
        return {"kv/k_scale_mean": 1.0}

    parts.calibrate_kv = calibrate  # type: ignore[method-assign]
    train_pool, _ = task_examples(cfg)
    metrics = rl_step(cfg, parts, train_pool[:4], 1)
    assert len(seen) == 1 and 0 < seen[0] <= 60  # of the 16 rows' ~200 tokens
    assert metrics["kv/calibration_tokens"] == seen[0]
