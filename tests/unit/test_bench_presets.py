"""``fp8rl bench step --preset``: a named layout is the measured table's command, and flags still override it."""

from __future__ import annotations

from pathlib import Path

import pytest

from fp8rl.bench.presets import PRESETS
from fp8rl.bench.step import StepBench, step_config
from fp8rl.bench.step_cli import resolve_preset
from fp8rl.cli import build_parser
from fp8rl.config.flags import apply_overrides, apply_ray_flags
from fp8rl.errors import UserError
from fp8rl.models.shapes import SHAPES

REPO = Path(__file__).resolve().parents[2]


def _configs(argv: list[str]) -> tuple[dict, list]:
    args = build_parser().parse_args(["bench", "step", *argv])
    sizes, base = resolve_preset(args)
    apply_ray_flags(base, args)
    apply_overrides(base, args.set)
    recipes = args.recipes or sizes["recipes"]
    bench = StepBench(
        recipes=recipes, prompts=sizes["prompts"], samples=sizes["samples"], max_tokens=sizes["max_tokens"],
        steps=sizes["steps"], warmup=sizes["warmup"],
        micro_batch_tokens=args.micro_batch_tokens or sizes.get("micro_batch_tokens"),
    )  # fmt: skip
    return {**sizes, "shape": args.shape}, [step_config(base, r, bench, "work") for r in recipes]


# The layouts of the 8B tables' runs before presets, as their config files held them (the files are gone: the
# presets hold the settings); docs/benchmarks.md gives those runs' commands as a preset and the flags that differ.
_TWO_GPU_FSDP = """
rollout: {engine: vllm, gpu_memory_utilization: 0.45, enforce_eager: false, max_model_len: 2048}
ray: {trainer_workers: 2, rollout_workers: 2, trainer_sharding: fsdp, layout: colocated, sync: ipc,
      object_store_mb: 2048, actor_timeout_s: 1800}
"""
_MEASURED_H200 = _TWO_GPU_FSDP + "optim: {activation_checkpointing: true, compile_elementwise: true}\n"
_MEASURED_H100 = _TWO_GPU_FSDP + "optim: {activation_checkpointing: true, offload_optimizer_state: true}\n"
_H200_SETTINGS = ["--set", "rollout.kv_calibration_tokens=16384", "--set", "ray.sleep_after_sync=false"]


def _measured(tmp_path: Path, layout: str, argv: list[str]) -> tuple[dict, list]:
    config = tmp_path / "measured.yaml"
    config.write_text(layout)
    return _configs(["--shape", "llama-8b", "--config", str(config), *argv])


def test_the_h200_preset_is_the_measured_command(tmp_path: Path) -> None:
    """The 8B table's command before presets: a config file, eight flags and three --set."""
    sizes_m, cfgs_m = _measured(tmp_path, _MEASURED_H200, [
        "--recipes", "bf16,fp8-e2e-row-kv", "--prompts", "64", "--samples", "8", "--max-tokens", "1024",
        "--steps", "2", "--warmup", "1", "--micro-batch-tokens", "16384", *_H200_SETTINGS,
        "--set", "rollout.fp8_scaling=channel", "--set", "rollout.prefix_caching=false",
        "--set", "rollout.kv_calibration_tokens=4096",
    ])  # fmt: skip
    sizes_p, cfgs_p = _configs(["--preset", "llama-8b-h200x2"])
    assert sizes_p["shape"] == sizes_m["shape"] == "llama-8b"
    assert [c.model_dump() for c in cfgs_p] == [c.model_dump() for c in cfgs_m]


def test_the_earlier_8b_runs_are_their_preset_with_the_flags_docs_give(tmp_path: Path) -> None:
    """docs/benchmarks.md's "8B step by recipe (2x H200)" and "8B on two H100s" runs, as the preset and flags."""
    h200_run = ["--recipes", "bf16,fp8-e2e-row,fp8-e2e-row-kv,fp8-e2e", "--set", "rollout.fp8_scaling=channel"]
    _, cfgs_m = _measured(tmp_path, _MEASURED_H200, [
        *h200_run, "--prompts", "64", "--samples", "8", "--max-tokens", "1024", "--steps", "2", "--warmup", "1",
        "--micro-batch-tokens", "16384", *_H200_SETTINGS,
    ])  # fmt: skip
    h200_preset = "--set rollout.prefix_caching=true --set rollout.kv_calibration_tokens=16384"
    _, cfgs_p = _configs(["--preset", "llama-8b-h200x2", *h200_run, *h200_preset.split()])
    assert [c.model_dump() for c in cfgs_p] == [c.model_dump() for c in cfgs_m]

    h100_run = ["--recipes", "bf16,fp8-e2e,fp8-e2e-kv", "--prompts", "32", "--micro-batch-tokens", "4096"]
    _, cfgs_m = _measured(tmp_path, _MEASURED_H100, [
        *h100_run, "--samples", "8", "--max-tokens", "1024", "--steps", "2", "--warmup", "1",
    ])  # fmt: skip
    h100_preset = (
        "--set optim.compile_elementwise=false --set rollout.fp8_scaling=recipe --set rollout.prefix_caching=true"
        " --set rollout.kv_calibration_tokens=null"
    )
    _, cfgs_p = _configs(["--preset", "llama-8b-h100x2", *h100_run, *h100_preset.split()])
    assert [c.model_dump() for c in cfgs_p] == [c.model_dump() for c in cfgs_m]
    docs = (REPO / "docs" / "benchmarks.md").read_text()
    for preset, run, flags in (("llama-8b-h200x2", h200_run, h200_preset), ("llama-8b-h100x2", h100_run, h100_preset)):
        command = f"--preset {preset} {' '.join(run)} {flags}"
        assert command in " ".join(docs.split()), f"docs/benchmarks.md lacks `fp8rl bench step {command}`"


def test_flags_config_and_set_override_the_preset(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("rollout: {gpu_memory_utilization: 0.6}\noptim: {lr: 3.0e-6}\n")
    sizes, cfgs = _configs([
        "--preset", "llama-8b-h200x2", "--prompts", "8", "--recipe", "bf16", "--config", str(cfg_file),
        "--set", "optim.lr=5e-6", "--trainer-workers", "1", "--rollout-workers", "1", "--shape", "llama-1b",
    ])  # fmt: skip
    assert sizes["prompts"] == 8 and sizes["shape"] == "llama-1b" and len(cfgs) == 1
    cfg = cfgs[0]
    assert cfg.recipe.name == "bf16" and cfg.grpo.prompts_per_step == 8
    assert cfg.rollout.gpu_memory_utilization == 0.6 and cfg.optim.lr == 5e-6
    assert cfg.ray is not None and cfg.ray.trainer_workers == 1 and cfg.ray.layout == "colocated"
    assert cfg.rollout.prefix_caching is False  # the preset's, untouched


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_valid_run_config_for_each_of_its_recipes(name: str) -> None:
    sizes, cfgs = _configs(["--preset", name])
    assert sizes["shape"] in SHAPES and len(cfgs) == len(PRESETS[name].recipes) >= 2
    assert cfgs[0].recipe.name == "bf16"  # every table is against bf16
    assert all(c.sampling.ignore_eos and c.sampling.max_tokens == sizes["max_tokens"] for c in cfgs)


def test_an_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(UserError, match="unknown benchmark preset 'h300'.*llama-8b-h200x2"):
        _configs(["--preset", "h300"])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_pipeline_and_bench_step_run_a_preset_with_the_same_configuration(name: str) -> None:
    """The fp8-benchmark pipeline's ``preset`` (``BenchPreset.run_fields``) and ``fp8rl bench step --preset`` give
    every recipe the same run config (the bench's work dir aside)."""
    from fp8rl.config import load_recipe, parse_run_config

    _, cfgs = _configs(["--preset", name])
    for cfg in cfgs:
        fields = {**PRESETS[name].run_fields({}), "recipe": load_recipe(cfg.recipe.name), "work_dir": "work"}
        assert parse_run_config(fields, "pipeline").model_dump() == cfg.model_dump()


def test_the_pipelines_run_config_overrides_the_preset() -> None:
    fields = PRESETS["llama-1b-1gpu"].run_fields({"rollout": {"engine": "torch"}, "grpo": {"prompts_per_step": 2}})
    assert fields["rollout"]["engine"] == "torch" and fields["rollout"]["max_model_len"] == 2048  # the preset's
    assert fields["grpo"] == {"prompts_per_step": 2, "group_size": 8} and fields["sampling"]["ignore_eos"] is True


def test_the_pipelines_parameters_take_the_given_value_else_the_presets_else_the_default() -> None:
    from fp8rl.bench.presets import pipeline_model, pipeline_recipes, pipeline_steps
    from fp8rl.config import CORE_RECIPES

    preset = PRESETS["llama-1b-1gpu"]
    assert pipeline_recipes("", []) == list(CORE_RECIPES)
    assert pipeline_recipes("llama-1b-1gpu", []) == list(preset.recipes)
    assert pipeline_recipes("llama-1b-1gpu", ["bf16"]) == ["bf16"]
    assert (pipeline_model("", ""), pipeline_model("llama-1b-1gpu", "")) == ("tiny", "shape:llama-1b")
    assert pipeline_model("llama-1b-1gpu", "hf://org/m") == "hf://org/m"
    assert pipeline_steps("", 0, -1) == (5, 2)
    assert pipeline_steps("llama-1b-1gpu", 0, -1) == (preset.steps, preset.warmup)
    assert pipeline_steps("llama-1b-1gpu", 1, 0) == (1, 0)
    for bad in (lambda: pipeline_recipes("h300", []), lambda: pipeline_model("h300", ""), lambda: pipeline_steps("h300", 0, -1)):  # fmt: skip
        with pytest.raises(UserError, match="preset: unknown benchmark preset 'h300'"):
            bad()
    with pytest.raises(UserError, match="recipe 'fp9'"):
        pipeline_recipes("", ["bf16", "fp9"])


def test_the_benchmark_model_and_recipes_components_resolve_the_preset() -> None:
    from components.benchmark import benchmark_model, benchmark_recipes

    assert benchmark_recipes.python_func(preset="llama-1b-1gpu", recipes=[]) == list(PRESETS["llama-1b-1gpu"].recipes)
    assert benchmark_model.python_func(preset="llama-1b-1gpu", model_source="") == "shape:llama-1b"


def test_set_and_the_ray_flags_leave_the_preset_as_it_was() -> None:
    before = repr(PRESETS["llama-8b-h200x2"])
    _configs(
        ["--preset", "llama-8b-h200x2", "--set", "rollout.prefix_caching=true", "--set", "ray.object_store_mb=4096"]
    )
    assert repr(PRESETS["llama-8b-h200x2"]) == before
    _, cfgs = _configs(["--preset", "llama-8b-h200x2"])
    assert cfgs[0].rollout.prefix_caching is False and cfgs[0].ray is not None and cfgs[0].ray.object_store_mb == 2048
