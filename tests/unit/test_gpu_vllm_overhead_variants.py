"""``experiments/gpu_vllm_overhead.py``'s variant names (the script runs on the lent GPU; its names are parsed here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fp8rl.config import RolloutConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
overhead = pytest.importorskip("gpu_vllm_overhead")


def test_a_variant_names_recipe_scaling_backend_and_engine_arguments() -> None:
    base = RolloutConfig(engine="vllm", engine_kwargs={"max_num_seqs": 256})
    recipe, rollout = overhead.variant_settings("fp8-row-kv@TRITON_ATTN+block_size=32+max_num_seqs=512", base)
    assert (recipe.name, recipe.kv_cache) == ("fp8-rollout", "fp8")
    assert (rollout.fp8_scaling, rollout.kv_scaling, rollout.attention_backend) == ("channel", "tensor", "TRITON_ATTN")
    assert rollout.engine_kwargs == {"block_size": 32, "max_num_seqs": 512}  # the variant's over the run's
    recipe, rollout = overhead.variant_settings("bf16", base)
    assert (recipe.name, recipe.kv_cache, rollout.engine_kwargs) == ("bf16", "bf16", {"max_num_seqs": 256})
    assert overhead.variant_base("fp8-kvh@TRITON_ATTN+block_size=32") == "fp8-kvh"


@pytest.mark.parametrize("variants", ["bf16,fp8-kv+block_size", "bf16,int8"])
def test_unknown_variants_are_refused(variants: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["gpu_vllm_overhead.py", "--variants", variants])
    with pytest.raises(SystemExit):
        overhead.parse_args()
