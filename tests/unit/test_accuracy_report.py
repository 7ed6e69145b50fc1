"""The accuracy study's report: records from MLflow histories, the per-recipe summary, the targets, and a short real
study on CPU (tiny model, several ``fp8rl train`` processes at once, stopped and resumed) read back from MLflow."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml

from fp8rl.accuracy import CHECKPOINT_BYTES_PER_PARAMETER, disk_needed, model_parameters, run_study
from fp8rl.accuracy.report import (
    RunRecord,
    StudyReport,
    check_targets,
    common_eval_step,
    parity_verdict,
    run_record,
    study_report,
    summarize,
)
from fp8rl.errors import UserError


def _record(recipe: str, seed: int, start: float, end: float, tmpe: float) -> RunRecord:
    return RunRecord(recipe, seed, 40, start, end, tmpe, tmpe - 1, tmpe - 1, 210, 210, "FINISHED", f"{recipe}{seed}")


def _study(bf16_end: list[float], e2e_end: list[float], no_is: float, tis: float, tmpe: dict[str, float]) -> list:
    out = []
    for seed, (b, e) in enumerate(zip(bf16_end, e2e_end, strict=True)):
        out += [
            _record("bf16", seed, 0.25, b, tmpe["bf16"]),
            _record("fp8-e2e-row", seed, 0.25, e, tmpe["e2e"]),
            _record("fp8-rollout-no-is", seed, 0.25, no_is, tmpe["rollout"]),
            _record("fp8-rollout", seed, 0.25, tis, tmpe["rollout"]),
        ]
    return out


def test_summary_is_mean_and_sample_std_over_seeds() -> None:
    records = _study([0.40, 0.44, 0.48], [0.41, 0.43, 0.47], 0.3, 0.4, {"bf16": 1.04, "e2e": 1.10, "rollout": 1.2})
    bf16 = summarize(records)[0]
    assert bf16.recipe == "bf16" and bf16.seeds == [0, 1, 2]
    assert bf16.accuracy_end == pytest.approx((0.44, statistics.stdev([0.40, 0.44, 0.48])))
    assert bf16.gain == pytest.approx(0.19)


def test_targets_hold_and_fail_as_the_numbers_say() -> None:
    good = _study([0.40, 0.44, 0.48], [0.41, 0.43, 0.47], 0.30, 0.40, {"bf16": 1.04, "e2e": 1.10, "rollout": 1.2})
    held = {t.claim: t.held for t in check_targets(good)}
    assert all(held.values()), held
    # bf16 learns 5 points only; fp8-e2e ends 3 points under bf16's lowest seed; e2e's mismatch above fp8-rollout's;
    # TIS closes 25% of the gap
    bad = _study([0.28, 0.30, 0.32], [0.24, 0.25, 0.26], 0.22, 0.24, {"bf16": 1.04, "e2e": 1.3, "rollout": 1.2})
    held = {t.claim: t.held for t in check_targets(bad)}
    assert not any(held.values()), held
    # no gap between fp8-rollout without correction and bf16: nothing for TIS to close
    nogap = _study([0.4, 0.4, 0.4], [0.4, 0.4, 0.4], 0.45, 0.45, {"bf16": 1.0, "e2e": 1.1, "rollout": 1.2})
    tis = [t for t in check_targets(nogap) if "TIS" in t.claim]
    assert len(tis) == 1 and tis[0].held is None
    # a gap smaller than the seeds' spread is no gap either
    noisy = _study([0.30, 0.45, 0.60], [0.4, 0.4, 0.4], 0.43, 0.30, {"bf16": 1.0, "e2e": 1.1, "rollout": 1.2})
    tis = [t for t in check_targets(noisy) if "TIS" in t.claim]
    assert tis[0].held is None and "within the seeds' spread" in tis[0].detail


def test_each_fp8_recipe_is_said_at_parity_or_so_many_points_under_bf16() -> None:
    bf16 = [0.44, 0.52, 0.58]  # mean 0.513
    assert parity_verdict(0.459, bf16) == "at parity"  # inside the seeds' range
    assert parity_verdict(0.60, bf16) == "at parity"  # over it
    assert parity_verdict(0.431, bf16) == "8.2 points under BF16 (outside the seeds' spread)"
    assert parity_verdict(0.505, [0.51, 0.515, 0.52]) == "at parity"  # under the range, within 1 point of the mean
    assert parity_verdict(0.495, [0.51, 0.515, 0.52]) == "2.0 points under BF16 (outside the seeds' spread)"
    records = [_record("bf16", s, 0.2, e, 1.0) for s, e in enumerate(bf16)]
    records += [_record("fp8-e2e-row-kv", s, 0.2, 0.431, 1.2) for s in range(3)]
    records += [_record("fp8-e2e-kv", s, 0.2, e, 1.1) for s, e in enumerate((0.45, 0.5, 0.55))]
    table = StudyReport(records, summarize(records)).markdown()
    rows = {line.split("|")[1].strip(): line.split("|")[8].strip() for line in table.splitlines()[2:5]}
    assert rows == {"bf16": "-", "fp8-e2e-row-kv": "8.2 points under BF16 (outside the seeds' spread)",
                    "fp8-e2e-kv": "at parity"}  # fmt: skip


def test_record_compares_at_a_common_step_and_needs_step_zero() -> None:
    h = {
        "eval/accuracy": [(0, 0.2), (10, 0.3), (20, 0.5)],
        "time/step_s": [(s, 1.0) for s in range(1, 21)],
        "mismatch/token_mult_prob_error": [(s, 1.0 + (0.1 if s > 10 else 0.0)) for s in range(1, 21)],
    }
    short = {**h, "eval/accuracy": h["eval/accuracy"][:2], "time/step_s": h["time/step_s"][:12]}
    assert common_eval_step([h, short]) == 10
    r = run_record("bf16", 0, "FINISHED", "id", {"fp8_linears_engine": "0"}, h, at_step=10)
    assert (r.steps, r.accuracy_start, r.accuracy_end) == (10, 0.2, 0.3)
    assert r.token_mult_prob_error == pytest.approx(1.0)  # steps 1-10 only
    assert "compared at step 10 of 20" in r.status
    with pytest.raises(UserError, match="step-0"):
        run_record("bf16", 0, "FAILED", "id", {}, {"eval/accuracy": [(10, 0.3)]})


@pytest.mark.slow
def test_a_short_study_on_cpu_stops_resumes_and_reports(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """Two recipes x two seeds of the tiny model, two processes at once: a first pass stopped by its deadline, a
    second that resumes and finishes, then the report from MLflow (records, plots and tables on the parent)."""
    from mlflow import MlflowClient

    from fp8rl.accuracy.cli import study_configs
    from fp8rl.tracking import configure_mlflow

    config = tmp_path / "study.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "task": {"type": "word-problems", "difficulty": 1, "train_size": 64},
                "reward": {"type": "exact-match", "extract": "last-number"},
                "sampling": {"max_tokens": 4},
                "grpo": {"prompts_per_step": 2, "group_size": 2},
                "optim": {"micro_batch_size": 4},
                "steps": 2,
                "eval_every": 1,
                "eval_examples": 6,
                "eval_samples": 0,
                "checkpoint_every": 1,
                "device": "cpu",
                "work_dir": str(tmp_path / "work"),
            }
        )
    )
    args = type("Args", (), {})()
    args.__dict__.update(
        config=str(config), model=str(tiny_models["tiny"]), steps=None, work_dir=None, device=None, set=None,
        seeds="0,1", recipes=["bf16", "fp8-e2e"],
    )  # fmt: skip
    cfgs = study_configs(args)
    first = run_study(cfgs, "acc", parallel=2, deadline_s=1.0, log=lambda _: None)
    assert first["pending"] and not first["failed"]  # stopped at the deadline, to resume
    second = run_study(cfgs, "acc", parallel=2, log=lambda _: None)
    assert sorted(second["done"]) == ["bf16-seed0", "bf16-seed1", "fp8-e2e-seed0", "fp8-e2e-seed1"], second

    out = tmp_path / "accuracy-tiny.json"
    parent = (tmp_path / "work" / "acc" / "parent_run_id").read_text().strip()
    report = study_report("fp8rl", parent, tmp_path / "work", out)
    records = json.loads(out.read_text())
    assert len(records) == 4
    for r in records:
        assert {"recipe", "seed", "steps", "accuracy_start", "accuracy_end", "token_mult_prob_error"} <= r.keys()
        assert r["steps"] == 2 and 0.0 <= r["accuracy_end"] <= 1.0 and r["token_mult_prob_error"] >= 1.0
        assert (r["fp8_linears_engine"] > 0) == (r["recipe"] == "fp8-e2e")
    assert [s.recipe for s in report.summaries] == ["bf16", "fp8-e2e"]
    client = MlflowClient(tracking_uri=configure_mlflow(tmp_path / "work"))
    artifacts = {a.path for a in client.list_artifacts(parent)} | {
        a.path for a in client.list_artifacts(parent, "plots")
    }
    assert {"accuracy.md", "accuracy.json", "plots/accuracy.png", "plots/token_mult_prob_error.png"} <= artifacts
    children = client.search_runs(
        [client.get_run(parent).info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'"
    )
    assert len(children) == 4 and {c.info.status for c in children} == {"FINISHED"}  # one MLflow run each, resumed
    # a finished run's loop checkpoints are gone (only a resume reads them); its log and config stay
    runs = tmp_path / "work" / "acc" / "runs"
    assert not list(runs.glob("*/checkpoints")) and len(list(runs.glob("*/train.log"))) == 4


def test_model_parameters_reads_the_safetensors_headers(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The count from the headers alone is the model's own (tied weights once), across shards too; a directory
    without safetensors gives None, a broken file names itself."""
    from transformers import AutoModelForCausalLM

    for name in ("tiny", "small-sharded"):
        model = AutoModelForCausalLM.from_pretrained(tiny_models[name])
        assert model_parameters(tiny_models[name]) == sum(p.numel() for p in model.parameters())
    assert len(list(tiny_models["small-sharded"].glob("*.safetensors"))) > 1
    assert model_parameters(tmp_path) is None
    (tmp_path / "model.safetensors").write_bytes(b"\x05")
    with pytest.raises(UserError, match="model.safetensors: not a readable safetensors file"):
        model_parameters(tmp_path)


def test_disk_needed_counts_the_runs_at_once_and_what_finished_runs_keep() -> None:
    one = 1000 * CHECKPOINT_BYTES_PER_PARAMETER
    assert disk_needed(1000, runs=12, parallel=9, keep_checkpoints=False, keep=2) == 9 * 3 * one  # 2 + 1 being written
    assert disk_needed(1000, runs=2, parallel=9, keep_checkpoints=False, keep=2) == 2 * 3 * one
    assert disk_needed(1000, runs=12, parallel=9, keep_checkpoints=True, keep=2) == (9 * 3 + 3 * 2) * one
    assert disk_needed(1000, runs=12, parallel=9, keep_checkpoints=True, keep=1) == (9 * 2 + 3 * 1) * one


def test_a_study_the_disk_cannot_hold_stops_before_any_run(
    tmp_path: Path, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 runs of Gemma-3-270M at once need 12 x 3 checkpoints of 3.2 GB; a disk with less free stops the study
    with an error naming --parallel before it starts a run or an MLflow parent run.  The free space is what this
    test sets (shutil.disk_usage): a full disk is not something to make here."""
    from collections import namedtuple

    from fp8rl.accuracy import study as accuracy
    from fp8rl.config import load_recipe, parse_run_config

    usage = namedtuple("usage", "total used free")
    base = {"recipe": load_recipe("bf16").model_dump(), "model": str(tiny_models["tiny"]), "checkpoint_every": 1,
            "work_dir": str(tmp_path / "work")}  # fmt: skip
    cfgs = [parse_run_config({**base, "seed": s}, "test") for s in range(12)]
    need = disk_needed(model_parameters(tiny_models["tiny"]) or 0, 12, 12, keep_checkpoints=False, keep=2)
    monkeypatch.setattr(accuracy.shutil, "disk_usage", lambda _p: usage(need * 2, need, need - 1))
    with pytest.raises(UserError, match=r"--parallel 12: the runs' loop checkpoints need up to .* GB.* are free"):
        run_study(cfgs, "acc", parallel=12, log=lambda _: None)
    assert not (tmp_path / "work" / "acc").exists()  # no run, no parent run
    lines: list[str] = []
    monkeypatch.setattr(accuracy.shutil, "disk_usage", lambda _p: usage(need * 2, need, need))
    accuracy._check_disk(
        [accuracy.StudyRun(c, tmp_path / str(c.seed)) for c in cfgs], 12, False, tmp_path, lines.append
    )
    assert lines and "loop checkpoints of" in lines[0]


def test_the_documented_study_command_parses_into_its_runs() -> None:
    """docs/accuracy.md's `fp8rl accuracy run` command: 6 recipes x 3 seeds of the word-problem task on vLLM, the FP8
    engine per channel (SmolLM2's widths are not whole 128-tiles), checkpointed so that a stopped study resumes."""
    import re
    import shlex

    from fp8rl.accuracy.cli import study_configs
    from fp8rl.cli import build_parser

    root = Path(__file__).parents[2]
    doc = (root / "docs/accuracy.md").read_text()
    command = re.search(r"fp8rl accuracy run ((?:[^\n]*\\\n)*[^\n]*)", doc).group(1).replace("\\\n", " ")  # type: ignore[union-attr]
    args = build_parser().parse_args(["accuracy", "run", *shlex.split(command.replace("docs/", str(root) + "/docs/"))])
    cfgs = study_configs(args)
    names = [c.recipe.name for c in cfgs[::3]]
    assert names == ["bf16", "fp8-rollout-no-is", "fp8-rollout", "fp8-e2e", "fp8-e2e-row", "fp8-e2e-row-kv"]
    assert [c.seed for c in cfgs[:3]] == [0, 1, 2] and len(cfgs) == 18
    assert {c.recipe.correction.type for c in cfgs if c.recipe.name.startswith("fp8-rollout")} == {"none", "tis"}
    for c in cfgs:
        assert c.rollout.engine == "vllm" and c.rollout.fp8_scaling == "channel" and c.checkpoint_every > 0
        assert c.task.type == "word-problems" and c.eval_examples >= 500 and c.reward.extract == "last-number"  # type: ignore[union-attr]


@pytest.mark.slow
def test_a_run_stopped_after_a_checkpoint_resumes_into_the_same_mlflow_run(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    """A study run stopped (SIGTERM, as at a deadline) once it has checkpointed resumes from that checkpoint when the
    study is started again, logging into the same MLflow run: every step once, none lost."""
    import sys
    import time

    from mlflow import MlflowClient

    from fp8rl.accuracy.study import StudyRun, _launch, _stop, parent_run
    from fp8rl.config import load_recipe, parse_run_config
    from fp8rl.tracking import configure_mlflow

    work = tmp_path / "work"
    data = {
        "recipe": load_recipe("bf16").model_dump(), "model": str(tiny_models["tiny"]),
        "task": {"type": "word-problems", "difficulty": 1, "train_size": 64},
        "sampling": {"max_tokens": 4}, "grpo": {"prompts_per_step": 2, "group_size": 2},
        "steps": 30, "eval_every": 10, "eval_examples": 4, "eval_samples": 0, "checkpoint_every": 1,
        "checkpoint_keep": 1, "device": "cpu", "work_dir": str(work),
    }  # fmt: skip
    cfg = parse_run_config(data, "test")
    run = StudyRun(cfg, work / "acc" / "runs" / "bf16-seed0")
    _launch(run, parent_run([cfg], "acc"), sys.executable)
    first, checkpoint = (run.directory / "checkpoints" / f"step-00000{s}" for s in (1, 2))
    deadline = time.monotonic() + 240
    while (not checkpoint.exists() or first.exists()) and time.monotonic() < deadline and run.proc.poll() is None:  # type: ignore[union-attr]
        time.sleep(0.05)
    _stop(run)
    assert checkpoint.exists() and not first.exists() and not run.done  # checkpoint_keep 1: the newest only
    # the estimate the study checks the disk with: 12 bytes a parameter, give or take the RNG and schedule state
    size = (checkpoint / "state.pt").stat().st_size
    params = model_parameters(tiny_models["tiny"]) or 0
    assert 0.95 < size / (params * CHECKPOINT_BYTES_PER_PARAMETER) < 1.15, (size, params)
    assert "resumed" not in (run.directory / "train.log").read_text()

    outcome = run_study([cfg], "acc", log=lambda _: None)
    assert outcome["done"] == ["bf16-seed0"]
    assert "resumed from the checkpoint of step" in (run.directory / "train.log").read_text()
    client = MlflowClient(tracking_uri=configure_mlflow(work))
    parent = (work / "acc" / "parent_run_id").read_text().strip()
    (child,) = client.search_runs(
        [client.get_run(parent).info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'"
    )
    assert child.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(child.info.run_id, "time/step_s")]
    assert sorted(steps) == list(range(1, 31))  # every step exactly once across the two processes
    assert [m.step for m in client.get_metric_history(child.info.run_id, "eval/accuracy")] == [0, 10, 20, 30]
