"""fp8rl.bench: the throughput benchmark (real RL steps on the tiny model), held-out evaluation, the report."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import pytest
from mlflow import MlflowClient

from fp8rl.bench import throughput
from fp8rl.bench.report import COLUMNS, PLOTS, build_comparison_report, markdown_table
from fp8rl.bench.throughput import ThroughputResult, benchmark_recipe, resolve_device
from fp8rl.build import build_parts
from fp8rl.config import RunConfig, load_recipe
from fp8rl.errors import UserError
from fp8rl.evaluation.checkpoint import evaluate_checkpoint
from fp8rl.tracking import MlflowSink, configure_mlflow, recipe_tags, start_parent_run

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")

SMALL = {"grpo": {"prompts_per_step": 2, "group_size": 2}, "eval_examples": 8, "eval_samples": 2}


def small_cfg(recipe: str, work_dir: Path | str = "work") -> RunConfig:
    return RunConfig.model_validate({**SMALL, "recipe": load_recipe(recipe), "steps": 3, "work_dir": str(work_dir)})


@pytest.fixture(autouse=True)
def local_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.mark.parametrize("recipe", ["bf16", "fp8-e2e"])
def test_benchmark_measures_real_steps(tiny_models: dict[str, Path], recipe: str) -> None:
    lines: list[str] = []
    result = benchmark_recipe(small_cfg(recipe), tiny_models["tiny"], "cpu", steps=2, warmup_steps=1, log=lines.append)
    assert (result.recipe, result.device, result.steps, result.warmup_steps) == (recipe, "cpu", 2, 1)
    assert result.device_name.startswith("CPU")
    assert result.rollout_tokens_per_s > 0 and result.train_tokens_per_s > 0 and result.step_s > 0
    assert 0 < result.response_tokens <= SMALL["grpo"]["group_size"] * 8
    bf16_bytes = build_parts(small_cfg(recipe), tiny_models["tiny"], "cpu").bf16_bytes
    # FP8 recipes sync 1-byte weights (+ scales) for the decoder linears; bf16 syncs what it serves
    if recipe == "bf16":
        assert result.sync_bytes > 0.5 * bf16_bytes
    else:
        assert result.sync_bytes < 0.75 * bf16_bytes
    assert len(lines) == 3 and "warm-up" in lines[0] and "timed" in lines[2]
    assert set(result.metrics()) == {f"bench/{f}" for f in throughput.STEP_METRICS.values()}


def test_benchmark_reports_medians_of_timed_steps_only(
    monkeypatch: pytest.MonkeyPatch, tiny_models: dict[str, Path]
) -> None:
    """rl_step replaced by a script of numbers: the warm-up is dropped and each field is the median of the rest."""
    script = iter([1000.0, 10.0, 30.0, 20.0, 99.0])  # warm-up 1000, then 10, 30, 20, 99
    seen: list[int] = []

    def fake_step(cfg: RunConfig, parts: object, examples: list[object], step: int) -> dict[str, float]:
        assert cfg.verify_sync is False  # the bit-exact check is not part of the sync's cost
        seen.append(step)
        v = next(script)
        return {key: v + i for i, key in enumerate(throughput.STEP_METRICS)}

    monkeypatch.setattr(throughput, "rl_step", fake_step)
    result = benchmark_recipe(small_cfg("bf16"), tiny_models["tiny"], steps=4, warmup_steps=1, log=lambda _: None)
    assert seen == [1, 2, 3, 4, 5]
    for i, field in enumerate(throughput.STEP_METRICS.values()):
        assert getattr(result, field) == statistics.median([10 + i, 30 + i, 20 + i, 99 + i])


def test_benchmark_rejects_no_steps(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="steps >= 1"):
        benchmark_recipe(small_cfg("bf16"), tiny_models["tiny"], steps=0)


def test_resolve_device() -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") in ("cpu", "cuda")


def test_evaluate_checkpoint_reports_accuracy_and_lengths(tiny_models: dict[str, Path]) -> None:
    cfg = small_cfg("fp8-e2e")
    out = evaluate_checkpoint(cfg, tiny_models["tiny"], "cpu")
    assert set(out) == {
        "evaluate/accuracy",
        "evaluate/sampled_accuracy",
        "evaluate/response_tokens",
        "evaluate/truncated",
    }
    assert 0.0 <= out["evaluate/accuracy"] <= 1.0 and 0.0 <= out["evaluate/truncated"] <= 1.0
    assert 0 < out["evaluate/response_tokens"] <= cfg.sampling.max_tokens
    no_sampling = evaluate_checkpoint(cfg.model_copy(update={"eval_samples": 0}), tiny_models["tiny"], "cpu")
    assert "evaluate/sampled_accuracy" not in no_sampling
    assert no_sampling["evaluate/accuracy"] == out["evaluate/accuracy"]  # greedy is deterministic


# ---------------------------------------------------------------- report, against a real MLflow store


def _log_runs(work: Path, experiment: str) -> tuple[str, dict[str, str]]:
    parent = start_parent_run(experiment, "cmp", work)
    ids = {}
    for recipe, acc in (("bf16", 0.5), ("fp8-e2e", 0.25)):
        with MlflowSink(experiment, f"{recipe}-seed0", work, parent_run_id=parent, tags=recipe_tags(recipe)) as s:
            for step in range(3):
                s.log_metrics({"reward": 0.1 * step, "eval/accuracy": acc, "mismatch/token_mult_prob_error": 1.0}, step)
            s.log_metrics({"summary/initial_accuracy": 0.1, "summary/final_accuracy": acc}, step=3)
            s.log_metrics({"bench/sync_bytes": 2 * 2**20, "bench/rollout_tokens_per_s": 1234.4}, step=0)
            ids[recipe] = s.run_id
    return parent, ids


def test_report_reads_the_runs_back(tmp_path: Path) -> None:
    parent, ids = _log_runs(tmp_path, "report")
    uri = configure_mlflow(tmp_path)
    report = build_comparison_report("report", parent, uri, list(ids.values()), appendix_markdown="# Appendix\n")
    rows = report.table.splitlines()[2:]
    assert [r.split(" | ")[0] for r in rows] == ["| bf16", "| fp8-e2e"]
    bf16 = dict(zip([h for h, _, _ in COLUMNS], rows[0].split(" | ")[1:], strict=False))
    assert bf16["accuracy start"] == "0.100" and bf16["accuracy end"] == "0.500"
    assert bf16["sync MiB"] == "2.00" and bf16["rollout tok/s"] == "1234"
    assert bf16["evaluated accuracy"] == "n/a"  # not logged: said so, not zero
    # the FP8 recipe against bf16: 0.25 against one bf16 run at 0.5
    assert [r.split(" | ")[len(COLUMNS) + 1] for r in rows] == [
        "-",
        "25.0 points under BF16 (outside the seeds' spread)",
    ]
    assert set(report.plots) == set(PLOTS.values()) and all(p.startswith(b"\x89PNG") for p in report.plots.values())
    assert report.html.count("data:image/png;base64,") == len(PLOTS) and "<table>" in report.html
    assert report.markdown.startswith("# Recipe comparison") and "# Appendix" in report.markdown
    assert parent in report.markdown and report.table in report.markdown
    out = report.write(tmp_path / "out")
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == sorted(
        ["comparison.md", "comparison.html", *PLOTS.values()]
    )


def test_report_only_the_given_runs_and_all_of_them(tmp_path: Path) -> None:
    parent, ids = _log_runs(tmp_path, "subset")
    uri = configure_mlflow(tmp_path)
    one = build_comparison_report("subset", parent, uri, [ids["fp8-e2e"]])
    assert [r.recipe for r in one.runs] == ["fp8-e2e"]
    with pytest.raises(UserError, match="not recipe runs"):
        build_comparison_report("subset", parent, uri, [ids["bf16"], "no-such-run"])
    empty_parent = start_parent_run("subset", "empty", tmp_path)
    with pytest.raises(UserError, match="no recipe runs"):
        build_comparison_report("subset", empty_parent, uri)
    assert MlflowClient(uri).get_run(parent).info.status == "RUNNING"  # reading never ends the run


def test_markdown_table_escapes_and_marks_nan() -> None:
    from fp8rl.tracking import RunSummary

    run = RunSummary("id", "a|b", "my|recipe", "FAILED", 0, {"summary/final_accuracy": [(1, float("nan"))]})
    table = markdown_table([run])
    assert r"my\|recipe" in table and "| nan |" in table and "FAILED" in table


def test_throughput_result_round_trips() -> None:
    r = ThroughputResult("bf16", "cpu", "CPU", 3, 1, 10.0, 5.0, 0.1, 100.0, 1.0, 4.0)
    assert r.to_dict()["rollout_tokens_per_s"] == 10.0 and r.metrics()["bench/sync_bytes"] == 100.0


def test_bench_step_compares_recipes_in_one_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fp8rl bench step`` on random tiny weights: every recipe's real steps with responses run to max_tokens,
    the breakdown adds up, speedups are against the bf16 of the same run, JSON + Markdown + MLflow comparison."""
    import json

    from fp8rl.cli import main

    monkeypatch.delenv("FP8RL_QUANT_LAUNCH", raising=False)  # the defaults are asserted below
    work = tmp_path / "work"
    argv = ["bench", "step", "--shape", "tiny", "--recipes", "bf16,fp8-e2e", "--prompts", "2", "--samples", "2",
            "--max-tokens", "24", "--steps", "2", "--warmup", "1", "--device", "cpu", "--work-dir", str(work),
            "--verify-sync", "--profile-train", "--set", "rollout.fp8_scaling=channel"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((work / "bench-step" / "bench_step.json").read_text())
    # what every recipe ran with is recorded (bf16 ignores the FP8 scaling; fp8-e2e's syncs, verified, were per channel)
    assert doc["meta"]["rollout"]["fp8_scaling"] == "channel" and doc["meta"]["rollout"]["engine"] == "torch"
    assert doc["meta"]["optim"]["micro_batch_tokens"] == 16384 and not doc["meta"]["optim"]["compile_elementwise"]
    assert doc["meta"]["verify_sync"] is True and doc["meta"]["gpus"] == 0 and doc["meta"]["ray"] is None
    assert doc["meta"]["profile_train"] is True
    # the quantization kernels' launch configurations (the defaults: FP8RL_QUANT_LAUNCH unset) are recorded
    assert doc["meta"]["quant_launch"]["colwise"] == [64, 4, "split"] and not doc["meta"]["quant_launch_from_env"]
    by = {r["recipe"]: r for r in doc["results"]}
    assert list(by) == ["bf16", "fp8-e2e"] and doc["meta"]["max_tokens"] == 24
    for r in by.values():
        assert r["response_tokens"] == 24  # EOS ignored: every response runs to max_tokens
        parts = r["generate_s"] + r["logprob_s"] + r["train_s"] + r["sync_s"]
        assert 0 < parts <= r["step_s"] * 1.5 and r["idle_s"] >= 0
        assert r["steps"] == 2 and r["warmup_steps"] == 1 and r["peak_allocated_gb"] is None  # CPU
        # --profile-train: one more step (in the recipe's own process), its policy step's time by category
        assert r["train_device_ms"]["gemm"] > 0 and r["train_device_ms"]["other"] > 0 and r["profiled_train_s"] > 0
        assert set(r["train_kernel_calls"]) == set(r["train_device_ms"]) and r["train_kernel_calls"]["gemm"] >= 1
    assert by["bf16"]["speedup_vs_bf16"] == {"step": 1.0, "rollout": 1.0, "train": 1.0}
    up = by["fp8-e2e"]["speedup_vs_bf16"]
    assert up["step"] == pytest.approx(by["bf16"]["step_s"] / by["fp8-e2e"]["step_s"])
    table = (work / "bench-step" / "bench_step.md").read_text()
    assert "| fp8-e2e |" in table and f"{up['step']:.2f}x" in table
    assert "every weight sync verified bit for bit" in table
    assert "(rollout torch, FP8 rollout weights per channel, 16384-token micro-batches)" in table
    assert "Train phase by kernel category" in table
    g = by["fp8-e2e"]["train_kernel_calls"]["gemm"]
    assert f"gemm {g:,.0f} kernels ({by['fp8-e2e']['train_device_ms']['gemm'] / g:.3f} ms each)" in table
    assert (
        f"| fp8-e2e | {by['fp8-e2e']['profiled_train_s']:.2f} | {by['fp8-e2e']['train_device_ms']['gemm']:,.0f} |"
        in table
    )
    out = capsys.readouterr().out
    assert "(profiled, not timed)" in out  # the recipe's process's line, passed on
    png = (work / "bench-step" / "bench_step.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000  # the breakdown and speedup plot
    assert "MLflow comparison run" in out
    client = MlflowClient(tracking_uri=configure_mlflow(work))
    (exp,) = [e for e in client.search_experiments() if e.name == "fp8rl-bench"]
    runs = client.search_runs([exp.experiment_id])
    children = {r.data.tags.get("recipe"): r for r in runs if r.data.tags.get("mlflow.parentRunId")}
    assert set(children) == {"bf16", "fp8-e2e"}
    assert children["fp8-e2e"].data.metrics["bench/speedup_step"] == pytest.approx(up["step"])
    assert children["fp8-e2e"].data.metrics["bench/train_device_ms/gemm"] == pytest.approx(
        by["fp8-e2e"]["train_device_ms"]["gemm"]
    )
    assert children["fp8-e2e"].data.metrics["bench/train_kernel_calls/gemm"] == g
    (parent,) = [r for r in runs if not r.data.tags.get("mlflow.parentRunId")]
    logged = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"bench_step.json", "bench_step.md", "bench_step.png"} <= logged
    # the shape's checkpoint is reused by the next run; a bad shape or both model sources are clear errors
    assert main(["bench", "step", "--shape", "huge", "--work-dir", str(work), "--no-mlflow"]) == 2
    assert main(["bench", "step", "--work-dir", str(work)]) == 2
    err = capsys.readouterr().err
    assert "--shape: unknown model shape 'huge'" in err and "exactly one of --model DIR or --shape NAME" in err


def test_reward_time_is_idle_not_logprob(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A slow user reward (0.5 s a response) lands in the step's idle time, not in the trainer's logprob time."""
    (tmp_path / "slow_reward.py").write_text(
        "import time\n\ndef slow(response, answer, example):\n    time.sleep(0.5)\n    return 0.0\n"
    )
    reward = {"type": "python", "function": f"{tmp_path / 'slow_reward.py'}:slow", "workers": 1}
    cfg = RunConfig.model_validate({**SMALL, "recipe": load_recipe("bf16"), "work_dir": "work", "reward": reward})
    result = benchmark_recipe(cfg, tiny_models["tiny"], "cpu", steps=1, warmup_steps=0, log=lambda _: None)
    responses = SMALL["grpo"]["prompts_per_step"] * SMALL["grpo"]["group_size"]
    assert result.idle_s >= 0.5 * responses * 0.9
    assert result.logprob_s < 0.5


def test_bench_step_micro_batch_tokens_flag_wins_over_the_config() -> None:
    from fp8rl.bench.step import DEFAULT_MICRO_BATCH_TOKENS, StepBench, speedups, step_config

    base = {"optim": {"micro_batch_tokens": 2048, "lr": 1e-5}}
    assert step_config(base, "bf16", StepBench(), "w").optim.micro_batch_tokens == 2048
    flagged = step_config(base, "bf16", StepBench(micro_batch_tokens=4096), "w")
    assert flagged.optim.micro_batch_tokens == 4096 and flagged.optim.lr == 1e-5
    assert step_config({}, "bf16", StepBench(), "w").optim.micro_batch_tokens == DEFAULT_MICRO_BATCH_TOKENS
    # a recipe that measured nothing gets no speedup rather than a ZeroDivisionError
    zero = ThroughputResult("fp8-e2e", "cpu", "CPU", 1, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    base_r = ThroughputResult("bf16", "cpu", "CPU", 1, 0, 10.0, 10.0, 0.1, 1.0, 2.0, 8.0)
    ups = speedups([base_r, zero])
    assert ups["bf16"]["step"] == 1.0 and ups["fp8-e2e"]["step"] != ups["fp8-e2e"]["step"]  # NaN
    assert ups["fp8-e2e"]["rollout"] == 0.0


def test_step_report_names_kv_recalibration_and_sleep_memory_where_measured() -> None:
    from fp8rl.bench.step import report

    plain = ThroughputResult("bf16", "cuda", "GPU", 2, 1, 10.0, 10.0, 0.5, 1.0, 2.0, 8.0)
    kv = ThroughputResult(
        "fp8-e2e-kv",
        "cuda",
        "GPU",
        2,
        1,
        12.0,
        8.0,
        0.9,
        1.0,
        2.0,
        8.0,
        kv_calibrate_s=0.4,
        rollout_sleep_freed_gb=21.5,
        optimizer_offload_s=2.25,
        cuda_alloc_retries=3.0,
    )
    doc, md = report([plain, kv], {"model": "llama-1b"})
    assert "optimizer state to the host and back 2.25 s of train; 3 allocator retries in the policy step" in md
    assert doc["results"][1]["kv_calibrate_s"] == 0.4 and doc["results"][0]["kv_calibrate_s"] is None
    assert (
        "- fp8-e2e-kv: FP8 KV-cache recalibration 0.400 s of the sync; the sleeping rollout engines freed 21.5 GB "
        "for training (all workers together)" in md
    )
    assert "- bf16" not in md


def test_step_report_lists_the_quantization_kernels_by_launch_with_their_bandwidth() -> None:
    from fp8rl.bench.step import quantize_bytes, report

    rows, cols = 16384, 4096
    assert quantize_bytes(f"1x128/{rows}x{cols}/rowwise") == rows * cols * (2 + 1 + 4 / 128)
    assert quantize_bytes(f"1x128/{rows}x{cols}/transposed") == rows * cols * (2 + 1 + 4 / 128)
    assert quantize_bytes(f"1x128/{rows}x{cols}/rowwise_transposed") == rows * cols * (2 + 2 * (1 + 4 / 128))
    assert quantize_bytes("128x128/4096x4096/tiles_transposed") == 4096 * 4096 * (2 + 2 * (1 + 4 / 128**2))
    assert quantize_bytes("amax_kernel") is None
    label = f"1x128/{rows}x{cols}/rowwise"
    fp8 = ThroughputResult(
        "fp8-e2e", "cuda", "GPU", 2, 1, 10.0, 10.0, 0.5, 1.0, 2.0, 8.0,
        train_device_ms={"gemm": 100.0, "fp8_quantize": 20.0}, train_kernel_calls={"gemm": 10.0, "fp8_quantize": 40.0},
        train_quant_ms={label: 4.0, "amax_kernel": 1.0}, train_quant_calls={label: 10.0, "amax_kernel": 2.0},
    )  # fmt: skip
    doc, md = report([fp8], {"model": "llama-1b"})
    gbps = quantize_bytes(label) * 10 / 4e-3 / 1e9  # type: ignore[operator]
    assert f"| fp8-e2e | {label} | 10 | 4.0 | 0.400 | {gbps:,.0f} |" in md
    assert "| fp8-e2e | amax_kernel | 2 | 1.0 | 0.500 | - |" in md
    assert doc["results"][0]["train_quant_calls"][label] == 10.0
    assert "compute stream's idle" not in md  # no gaps measured (the CPU, or before this field)
    gaps = {"under_10us": 40.0, "1ms_and_more": 1200.0}, {"under_10us": 9000.0, "1ms_and_more": 30.0}
    fp8 = dataclasses.replace(fp8, train_gap_ms=gaps[0], train_gaps=gaps[1],
                              train_gap_ms_before={"other": 900.0, "gemm": 300.0})  # fmt: skip
    _, md = report([fp8], {"model": "llama-1b"})
    assert (
        "- fp8-e2e: 1,240 ms idle (under_10us 40 ms in 9,000, 1ms_and_more 1,200 ms in 30); before other 900 ms, gemm 300 ms"
        in md
    )
    _, md = report([dataclasses.replace(fp8, train_gap_ms_during_collective=850.0)], {"model": "llama-1b"})
    assert "before other 900 ms, gemm 300 ms; 850 ms of it while a collective ran" in md
    assert "by the kernel after" not in md
    fp8 = dataclasses.replace(fp8, train_gap_ms_before_kernel={"chunk_cat_cuda_kernel": 700.0, "nvjet": 300.0})
    _, md = report([fp8], {"model": "llama-1b"})
    assert "gemm 300 ms; the long gaps by the kernel after: `chunk_cat_cuda_kernel` 700 ms, `nvjet` 300 ms" in md
    assert '"other" kernels' not in md  # none reported
    top = {"vectorized_elementwise_kernel.CUDAFunctor_add.float": 1500.0, "CatArrayBatchedCopy": 300.0}
    fp8 = dataclasses.replace(fp8, train_top_other_ms=top, train_top_other_calls={"CatArrayBatchedCopy": 64.0})
    _, md = report([fp8], {"model": "llama-1b"})
    assert (
        "- fp8-e2e: `vectorized_elementwise_kernel.CUDAFunctor_add.float` 1,500 (0); `CatArrayBatchedCopy` 300 (64)"
        in md
    )


@pytest.mark.parametrize("verify", [False, True])
def test_bench_checks_every_sync_only_when_asked(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verify: bool
) -> None:
    import fp8rl.sync.inprocess as inprocess
    from fp8rl.bench.throughput import benchmark_recipe
    from fp8rl.config import RunConfig, load_recipe

    checked: list[int] = []
    real = inprocess.verify_engine_weights
    monkeypatch.setattr(inprocess, "verify_engine_weights", lambda e, p, v: (checked.append(v), real(e, p, v)))
    cfg = RunConfig.model_validate({"recipe": load_recipe("fp8-e2e"), "grpo": {"prompts_per_step": 2, "group_size": 2},
                                    "work_dir": str(tmp_path), "verify_sync": True})  # fmt: skip
    benchmark_recipe(cfg, tiny_models["tiny"], "cpu", steps=2, warmup_steps=1, log=lambda _: None, verify_sync=verify)
    assert checked == ([1, 2, 3] if verify else [])  # the config's verify_sync alone does not turn it on


def test_bench_step_ray_flags_override_the_configs_ray_section(tmp_path: Path) -> None:
    """``fp8rl bench step`` takes the same Ray flags as ``fp8rl train`` (layout, workers, sharding, sync): the GPU
    count and layout of a benchmark without writing a config."""
    from fp8rl.cli import build_parser
    from fp8rl.config.flags import apply_ray_flags

    args = build_parser().parse_args(["bench", "step", "--shape", "tiny", "--layout", "split", "--sync", "collective",
                                      "--trainer-workers", "2", "--trainer-sharding", "fsdp"])  # fmt: skip
    base = {"ray": {"rollout_workers": 2, "layout": "colocated"}}
    apply_ray_flags(base, args)
    assert base["ray"] == {"rollout_workers": 2, "layout": "split", "sync": "collective", "trainer_workers": 2,
                           "trainer_sharding": "fsdp"}  # fmt: skip
    untouched: dict = {}
    apply_ray_flags(untouched, build_parser().parse_args(["bench", "step", "--shape", "tiny"]))
    assert untouched == {}  # no flag: the loop stays in one process
    with pytest.raises(SystemExit):  # argparse names the flag and the choices
        build_parser().parse_args(["bench", "step", "--sync", "rdma"])


def test_set_overrides_any_run_config_field_after_the_config_and_flags(tmp_path: Path) -> None:
    """``--set KEY=VALUE`` (``fp8rl train`` and ``fp8rl bench step``): a dotted field path and a YAML value, applied
    last; a wrong path or value is an error naming it."""
    from fp8rl.cli import _run_configs, build_parser
    from fp8rl.config.flags import apply_overrides
    from fp8rl.errors import UserError

    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("steps: 5\noptim:\n  lr: 1.0e-4\n")
    args = build_parser().parse_args(["train", "--config", str(cfg_file), "--steps", "7", "--set", "optim.lr=1e-6",
                                      "--set", "seed=3", "--set", "rollout.kv_calibration_tokens=16384",
                                      "--set", "optim.betas=[0.9, 0.95]"])  # fmt: skip
    (cfg,) = _run_configs(args)
    assert cfg.steps == 7 and cfg.optim.lr == 1e-6 and cfg.seed == 3 and cfg.optim.betas == (0.9, 0.95)
    assert cfg.rollout.kv_calibration_tokens == 16384
    with pytest.raises(UserError, match="rollout.no_such_field"):
        _run_configs(build_parser().parse_args(["train", "--set", "rollout.no_such_field=1"]))
    for bad, message in [("optim", "expected KEY=VALUE"), ("optim..lr=1", "expected KEY=VALUE"),
                         ("steps.x=1", "steps is 5, not a section"), ("optim.lr=[1", "not valid YAML")]:  # fmt: skip
        with pytest.raises(UserError, match=message):
            apply_overrides({"steps": 5}, [bad])


def test_bench_step_writes_each_recipe_as_measured_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A recipe's result is on disk as soon as it is measured (OUT/recipes/NN-name.json); ``--resume`` reads back
    the recipes measured with the same settings and runs only the rest; other settings are an error naming the
    file (exit 2), and nothing is read back without ``--resume``."""
    import json

    from fp8rl.cli import main

    work = tmp_path / "work"
    common = ["bench", "step", "--shape", "tiny", "--prompts", "2", "--samples", "2", "--steps", "1", "--warmup",
              "0", "--device", "cpu", "--work-dir", str(work), "--no-mlflow", "--one-process"]  # fmt: skip
    assert main([*common, "--recipes", "bf16", "--max-tokens", "6"]) == 0
    part = work / "bench-step" / "recipes" / "01-bf16.json"
    first = json.loads(part.read_text())["result"]
    assert first["recipe"] == "bf16" and first["response_tokens"] == 6
    capsys.readouterr()
    assert main([*common, "--recipes", "bf16,fp8-e2e", "--max-tokens", "6", "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"recipe 1/2 bf16: measured before, read from {part}" in out and "recipe 2/2 fp8-e2e" in out
    doc = json.loads((work / "bench-step" / "bench_step.json").read_text())
    by = {r["recipe"]: r for r in doc["results"]}
    assert by["bf16"]["step_s"] == first["step_s"]  # read back, not measured again
    assert (work / "bench-step" / "recipes" / "02-fp8-e2e.json").is_file()
    # other settings: refused, naming the file and what differs
    assert main([*common, "--recipes", "bf16", "--max-tokens", "7", "--resume"]) == 2
    assert f"--resume: {part} was measured with other settings (config differ)" in capsys.readouterr().err
    # without --resume the recipe is measured again and its file replaced
    assert main([*common, "--recipes", "bf16", "--max-tokens", "7"]) == 0
    assert json.loads(part.read_text())["result"]["response_tokens"] == 7


def test_a_failed_profiled_step_keeps_the_timed_numbers_and_exits_non_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--profile-train`` runs after the timed steps: if it fails, the recipe's measured numbers are still written,
    the error is in the result and the Markdown, and the command exits 1 saying which recipe's profile failed."""
    import json

    from fp8rl.cli import main
    from fp8rl.train.trainer import TorchTrainer

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("profiler start failed | in CUPTI")

    monkeypatch.setattr(TorchTrainer, "profile_next_policy_step", broken)
    work = tmp_path / "work"
    argv = ["bench", "step", "--shape", "tiny", "--recipes", "bf16", "--prompts", "2", "--samples", "2",
            "--max-tokens", "8", "--steps", "1", "--warmup", "0", "--device", "cpu", "--work-dir", str(work),
            "--profile-train", "--one-process", "--no-mlflow"]  # fmt: skip
    assert main(argv) == 1
    (r,) = json.loads((work / "bench-step" / "bench_step.json").read_text())["results"]
    assert r["step_s"] > 0 and r["train_device_ms"] is None
    assert r["train_profile_error"] == "RuntimeError: profiler start failed | in CUPTI"
    table = (work / "bench-step" / "bench_step.md").read_text()
    assert "| bf16 | failed: RuntimeError: profiler start failed \\| in CUPTI |" in table
    captured = capsys.readouterr()
    assert "the profiled step failed (the timed steps are kept)" in captured.out
    assert "--profile-train: the profiled step of bf16 failed: RuntimeError" in captured.err


def test_step_medians_keep_an_optional_metric_only_where_every_step_has_it() -> None:
    steps = [
        {"time/step_s": 3.0, "time/kv_calibrate_s": 0.2, "train/cuda_alloc_retries": 1.0},
        {"time/step_s": 1.0, "time/kv_calibrate_s": 0.4},
        {"time/step_s": 2.0, "time/kv_calibrate_s": 0.3},
    ]
    medians = throughput.step_medians(steps)
    assert medians["step_s"] == 2.0 and medians["kv_calibrate_s"] == 0.3
    assert "cuda_alloc_retries" not in medians  # one step reported it: not a median of the timed steps
    assert medians["sync_s"] == 0.0  # a step metric no step reported counts as 0
