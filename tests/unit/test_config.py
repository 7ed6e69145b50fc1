"""Recipes and run configs: valid built-ins, clear errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from fp8rl.config import BUILTIN_RECIPES, ConfigError, load_recipe, parse_recipe, parse_run_config


def test_builtin_recipes() -> None:
    recipes = {name: load_recipe(name) for name in BUILTIN_RECIPES}
    assert (recipes["bf16"].rollout_precision, recipes["bf16"].train_precision) == ("bf16", "bf16")
    assert (recipes["fp8-rollout"].rollout_precision, recipes["fp8-rollout"].train_precision) == ("fp8", "bf16")
    assert (recipes["fp8-e2e"].rollout_precision, recipes["fp8-e2e"].train_precision) == ("fp8", "fp8")
    assert recipes["fp8-e2e"].quant.granularity == "block"


def test_invalid_values_name_field_and_allowed_values(tmp_path: Path) -> None:
    bad = tmp_path / "r.yaml"
    bad.write_text("name: x\nrollout_precision: fp8\ntrain_precision: bf16\nquant: {granularity: channel}\n")
    with pytest.raises(ConfigError, match=r"quant.granularity: Input should be 'block', 'row' or 'tensor'"):
        load_recipe(str(bad))
    with pytest.raises(ConfigError, match=r"correction: Input tag 'foo'.*'none', 'tis', 'mis'"):
        parse_recipe(
            {"name": "x", "rollout_precision": "fp8", "train_precision": "bf16", "correction": {"type": "foo"}}
        )
    with pytest.raises(ConfigError, match="requires rollout_precision 'fp8'"):
        parse_recipe({"name": "x", "rollout_precision": "bf16", "train_precision": "fp8"})
    with pytest.raises(ConfigError, match=r"correction.tis.threshold: Input should be greater than 1"):
        parse_recipe(
            {
                "name": "x",
                "rollout_precision": "fp8",
                "train_precision": "fp8",
                "correction": {"type": "tis", "threshold": 0.5},
            }
        )
    with pytest.raises(ConfigError, match="not a built-in recipe"):
        load_recipe("fp4")
    with pytest.raises(ConfigError, match="grpo.group_size"):
        parse_run_config({"recipe": load_recipe("bf16").model_dump(), "grpo": {"group_size": 1}})
    with pytest.raises(ConfigError, match="bogus: Extra inputs are not permitted"):
        parse_run_config({"recipe": load_recipe("bf16").model_dump(), "bogus": 1})
