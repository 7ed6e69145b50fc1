"""``fp8rl bench rollout``: generation throughput per recipe, on the torch engine and the tiny model (CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8rl.bench.rollout import RolloutBench, bench_recipes, random_prompts, rollout_config
from fp8rl.cli import main
from fp8rl.errors import UserError

SIZES = ["--prompts", "3", "--prompt-len", "5", "--max-tokens", "6", "--repeats", "2", "--warmup", "1"]


def _run(tiny: Path, out: Path, *extra: str) -> dict:
    argv = ["bench", "rollout", "--model", str(tiny), "--engine", "torch", "--device", "cpu", *SIZES,
            "--work-dir", str(out.parent / "work"), "--output-dir", str(out), *extra]  # fmt: skip
    assert main(argv) == 0
    return json.loads((out / "bench_rollout.json").read_text())


def test_bench_rollout_measures_every_recipe_side_by_side(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench"
    doc = _run(tiny_models["tiny"], out, "--recipes", "bf16,fp8-rollout", "--one-process")
    by = {r["recipe"]: r for r in doc["results"]}
    assert list(by) == ["bf16", "fp8-rollout"] and {r["kv_cache"] for r in by.values()} == {"bf16"}
    # the torch engine holds the 2 x 7 decoder linears of the tiny model in FP8 for the FP8 recipe only
    assert by["bf16"]["fp8_linears"] == 0 and by["fp8-rollout"]["fp8_linears"] == 14
    for r in by.values():
        assert r["engine"] == "torch" and len(r["batches"]) == 2
        # EOS ignored: every batch is 3 responses of 6 tokens
        assert r["tokens"] == 18 and all(b["tokens"] == 18 for b in r["batches"])
        rates = sorted(b["tokens"] / b["seconds"] for b in r["batches"])
        assert r["tokens_per_s"] == pytest.approx(sum(rates) / 2)  # the median of two
        assert r["start_s"] > 0
    assert by["bf16"]["speedup_vs_bf16"] == 1.0
    up = by["fp8-rollout"]["tokens_per_s"] / by["bf16"]["tokens_per_s"]
    assert by["fp8-rollout"]["speedup_vs_bf16"] == pytest.approx(up)
    meta = doc["meta"]
    assert meta["rollout"]["engine"] == "torch" and meta["prompts"] == 3 and meta["max_tokens"] == 6
    table = (out / "bench_rollout.md").read_text()
    assert f"| fp8-rollout | bf16 | 14 | {by['fp8-rollout']['tokens_per_s']:,.0f} | {up:.2f}x |" in table
    assert sorted(p.name for p in out.iterdir()) == ["bench_rollout.json", "bench_rollout.md"]  # no temp files left
    assert "wrote " in capsys.readouterr().out


def test_bench_rollout_runs_each_recipe_in_its_own_process(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    doc = _run(tiny_models["tiny"], tmp_path / "bench", "--recipes", "bf16,fp8-rollout")
    assert [(r["recipe"], r["fp8_linears"], r["tokens"]) for r in doc["results"]] == [
        ("bf16", 0, 18), ("fp8-rollout", 14, 18)
    ]  # fmt: skip


def test_fp8_kv_cache_variants_follow_the_fp8_recipes() -> None:
    names = [(r.name, r.kv_cache) for r in bench_recipes(["bf16", "fp8-rollout", "fp8-e2e-row-kv"], fp8_kv=True)]
    assert names == [("bf16", "bf16"), ("fp8-rollout", "bf16"), ("fp8-rollout", "fp8"), ("fp8-e2e-row-kv", "fp8")]
    assert [r.kv_cache for r in bench_recipes(["bf16", "fp8-rollout"], fp8_kv=False)] == ["bf16", "bf16"]


def test_the_vllm_defaults_yield_to_the_config() -> None:
    (recipe,) = bench_recipes(["fp8-rollout"], fp8_kv=False)
    bench = RolloutBench(prompt_len=64, max_tokens=512)
    cfg = rollout_config({}, recipe, "vllm", bench, "work")
    assert cfg.rollout.max_model_len == 576 and cfg.rollout.gpu_memory_utilization == 0.8
    cfg = rollout_config({"rollout": {"gpu_memory_utilization": 0.5}, "ray": {}}, recipe, "vllm", bench, "w")
    assert cfg.rollout.gpu_memory_utilization == 0.5 and cfg.ray is None and cfg.work_dir == "w"
    assert rollout_config({}, recipe, "torch", bench, "w").rollout.max_model_len is None  # vLLM's settings only


def test_random_prompts_leave_out_the_special_tokens() -> None:
    prompts = random_prompts(8, 50, 6, {0, 5}, seed=1)
    assert len(prompts) == 8 and {len(p) for p in prompts} == {50}
    assert set().union(*prompts) == {1, 2, 3, 4}
    assert prompts == random_prompts(8, 50, 6, {0, 5}, seed=1)


def test_bad_input_is_a_clear_error(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["bench", "rollout", "--engine", "torch", "--device", "cpu", "--output-dir", str(tmp_path / "out")]
    assert main([*base, "--model", str(tiny_models["tiny"]), "--fp8-kv"]) == 2
    assert main([*base, "--model", str(tiny_models["tiny"]), "--max-tokens", "0"]) == 2
    assert main([*base, "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "recipe.kv_cache 'fp8' needs rollout.engine 'vllm'" in err and "--max-tokens must be >= 1" in err
    assert str(tmp_path / "missing") in err and not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="--warmup must be >= 0"):
        RolloutBench(warmup=-1)
