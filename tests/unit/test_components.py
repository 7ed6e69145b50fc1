"""The KFP components through their Python functions (``.python_func``), on the tiny model, with a real MLflow store.

The artifacts are kfp's own classes pointing at temporary paths, as the KFP executor builds them.
The RayJob backend runs against a stand-in for ``submit_rayjob`` that executes the RayJob's
entrypoint here (the real ``fp8rl train`` CLI), so the contract between the step and the job
(flags, staged files, the MLflow run it leaves, the trained checkpoint) is exercised for real.
"""

from __future__ import annotations

import json
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kfp.dsl import HTML, Artifact, Markdown, Metrics, Model
from mlflow import MlflowClient

from components.benchmark import benchmark
from components.compare import compare_recipes
from components.convert import convert_to_fp8
from components.evaluate import evaluate
from components.prepare_model import prepare_model
from components.rl_step import rl_step
from components.runtime import (
    TAG_FAILED_STEP,
    TAG_KFP_COMPONENT,
    TAG_KFP_PIPELINE,
    TAG_KFP_RUN_ID,
    MlflowRunRef,
    read_run_ref,
    run_config,
    runs_fail_with_the_step,
)
from components.sft_warmup import sft_warmup
from components.tracking import start_tracking
from fp8rl.config import ConfigError, load_recipe
from fp8rl.errors import UserError
from fp8rl.kube import rl_step as rayjob_backend
from fp8rl.models.loading import UnsupportedModelError

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")

# backend="process" keeps the RL step in the test's process; the default (local Ray) runs in
# tests/integration/test_pipeline_local.py
RUN_CONFIG = {
    "grpo": {"prompts_per_step": 2, "group_size": 2},
    "eval_examples": 8,
    "eval_samples": 1,
    "eval_every": 1,
}
KFP_RUN = "0f1e2d3c-kfp-run"
DOCS = Path(__file__).resolve().parents[2] / "docs"


def art(cls: type, tmp: Path, name: str) -> Any:
    return cls(name=name, uri=str(tmp / name), metadata={})


@pytest.fixture(autouse=True)
def local_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


# ---------------------------------------------------------------- prepare, warm-up, convert


def test_prepare_tiny_preset(tmp_path: Path) -> None:
    model = art(Model, tmp_path, "model")
    prepare_model.python_func(source="tiny", seed=3, model=model)
    assert json.loads((tmp_path / "model" / "config.json").read_text())["model_type"] == "llama"
    assert model.metadata == {"source": "tiny:tiny", "preset": "tiny", "seed": 3}


@pytest.mark.parametrize("as_uri", [False, True])
def test_prepare_imports_a_checkpoint_directory(tmp_path: Path, tiny_models: dict[str, Path], as_uri: bool) -> None:
    source = tiny_models["small-sharded"].as_uri() if as_uri else str(tiny_models["small-sharded"])
    model = art(Model, tmp_path, "model")
    prepare_model.python_func(source=source, seed=0, model=model)
    src_files = sorted(p.name for p in tiny_models["small-sharded"].iterdir())
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == src_files
    assert model.metadata == {"source": source}


@pytest.mark.parametrize(
    ("source", "error", "match"),
    [
        ("tiny-typo", UserError, "not a tiny preset"),
        ("s3://bucket/model", UserError, "unsupported scheme 's3'"),
        ("hf://just-a-name", UserError, "expected hf://<org>/<name>"),
    ],
)
def test_prepare_rejects_bad_sources(tmp_path: Path, source: str, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        prepare_model.python_func(source=source, seed=0, model=art(Model, tmp_path, "model"))
    assert not (tmp_path / "model").exists()  # nothing half-written


def test_prepare_rejects_a_directory_that_is_no_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README").write_text("hi")
    with pytest.raises(UnsupportedModelError, match=r"config\.json is missing"):
        prepare_model.python_func(source=str(tmp_path / "notes"), seed=0, model=art(Model, tmp_path, "model"))
    assert not (tmp_path / "model").exists()


def test_sft_warmup_trains_the_tiny_model_and_passes_imports_through(
    tmp_path: Path, tiny_models: dict[str, Path], tracking: Artifact
) -> None:
    base = art(Model, tmp_path, "base")
    prepare_model.python_func(source="tiny", seed=0, model=base)
    warm, metrics = art(Model, tmp_path, "warm"), art(Metrics, tmp_path, "metrics")
    step = {"mlflow_run": tracking, "pipeline_name": "test-pipeline", "kfp_run_id": KFP_RUN}
    sft_warmup.python_func(base_model=base, steps=2, model=warm, metrics=metrics, **step)
    assert (tmp_path / "warm" / "model.safetensors").is_file()
    assert warm.metadata["sft_steps"] == 2 and "sft/heldout_accuracy" in metrics.metadata
    assert (tmp_path / "warm" / "model.safetensors").read_bytes() != (
        tmp_path / "base" / "model.safetensors"
    ).read_bytes()
    # the warm-up is an MLflow run under the comparison run: options, loss, accuracy, datasets, versions
    ref = read_run_ref(tracking)
    client = MlflowClient(tracking_uri=ref.tracking_uri)
    sft = client.get_run(warm.metadata["sft_mlflow_run_id"])
    assert sft.info.status == "FINISHED" and sft.data.tags["mlflow.parentRunId"] == ref.run_id
    assert sft.data.tags[TAG_KFP_COMPONENT] == "sft-warmup" and sft.data.tags[TAG_KFP_RUN_ID] == KFP_RUN
    assert "recipe" not in sft.data.tags  # not a row of the recipe comparison
    assert sft.data.params["sft.steps"] == "2" and sft.data.params["task.max_operand"] == "20"
    assert [m.step for m in client.get_metric_history(sft.info.run_id, "sft/loss")] == [2]
    assert 0.0 <= sft.data.metrics["sft/heldout_accuracy"] <= 1.0 and "version.torch" in sft.data.tags
    inputs = {d.dataset.name: d for d in sft.inputs.dataset_inputs}
    assert set(inputs) == {"arithmetic-train", "arithmetic-test"}
    assert {t.value for d in inputs.values() for t in d.tags} == {"training", "evaluation"}
    assert json.loads(inputs["arithmetic-test"].dataset.profile) == {"num_rows": 200}

    imported = art(Model, tmp_path, "imported")
    prepare_model.python_func(source=str(tiny_models["small"]), seed=0, model=imported)
    with pytest.raises(UserError, match="set sft_steps=0"):
        sft_warmup.python_func(base_model=imported, steps=5, model=art(Model, tmp_path, "x"), metrics=metrics, **step)
    through = art(Model, tmp_path, "through")
    sft_warmup.python_func(base_model=imported, steps=0, model=through, metrics=art(Metrics, tmp_path, "m0"), **step)
    assert (tmp_path / "through" / "model.safetensors").read_bytes() == (
        tiny_models["small"] / "model.safetensors"
    ).read_bytes()


def test_convert_follows_the_recipe_and_reports(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    model = art(Model, tmp_path, "model")
    shutil.copytree(tiny_models["tiny"], tmp_path / "model")
    fp8, report = art(Model, tmp_path, "fp8"), art(Markdown, tmp_path, "report.md")
    convert_to_fp8.python_func(model=model, recipe="fp8-e2e", fp8_model=fp8, report=report)
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == list(load_recipe("fp8-e2e").quant.weight_block)
    text = (tmp_path / "report.md").read_text()
    assert "granularity=block" in text and "relative error" in text
    assert fp8.metadata["recipe"] == "fp8-e2e"
    with pytest.raises(ConfigError, match="not a built-in recipe"):
        convert_to_fp8.python_func(model=model, recipe="fp9", fp8_model=art(Model, tmp_path, "x"), report=report)


# ---------------------------------------------------------------- tracked steps, one MLflow store


@pytest.fixture
def tracking(tmp_path: Path) -> Artifact:
    run = art(Artifact, tmp_path, "mlflow_run")
    start_tracking.python_func(
        experiment="components", work_dir=str(tmp_path / "work"), pipeline_name="test-pipeline",
        kfp_run_id=KFP_RUN, kfp_run_name="run-name", mlflow_run=run,
    )  # fmt: skip
    return run


def test_start_tracking_writes_the_reference(tracking: Artifact, tmp_path: Path) -> None:
    ref = read_run_ref(tracking)
    assert ref.experiment == "components" and ref.work_dir == str(tmp_path / "work")
    assert ref.tracking_uri == f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}"
    assert tracking.metadata["run_id"] == ref.run_id
    run = MlflowClient(ref.tracking_uri).get_run(ref.run_id)
    assert run.info.status == "RUNNING"
    assert run.data.tags[TAG_KFP_RUN_ID] == KFP_RUN and run.data.tags[TAG_KFP_PIPELINE] == "test-pipeline"
    assert run.data.tags["kfp.run_name"] == "run-name" and run.data.tags[TAG_KFP_COMPONENT] == "start-tracking"


def test_read_run_ref_names_a_bad_file(tmp_path: Path) -> None:
    bad = art(Artifact, tmp_path, "bad")
    (tmp_path / "bad").write_text("{}")
    with pytest.raises(UserError, match="not an MLflow run reference"):
        read_run_ref(bad)


def test_run_config_overrides_and_refuses_clashes() -> None:
    ref = MlflowRunRef("id", "exp", "/w", "sqlite:///w")
    cfg = run_config("fp8-e2e", 3, 7, {"grpo": {"group_size": 4.0}}, ref)  # KFP hands JSON ints over as floats
    assert (cfg.steps, cfg.seed, cfg.grpo.group_size, cfg.work_dir, cfg.experiment) == (3, 7, 4, "/w", "exp")
    with pytest.raises(UserError, match=r"\['steps'\] are pipeline parameters"):
        run_config("bf16", 3, 0, {"steps": 5}, ref)
    with pytest.raises(ConfigError, match="grpo.group_size"):
        run_config("bf16", 3, 0, {"grpo": {"group_size": 1}}, ref)


def test_rl_evaluate_benchmark_compare(tracking: Artifact, tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    ref = read_run_ref(tracking)
    model = art(Model, tmp_path, "model")
    shutil.copytree(tiny_models["tiny"], tmp_path / "model")
    common: dict[str, Any] = {"seed": 0, "run_config": RUN_CONFIG}
    run_ids = []
    for recipe in ("bf16", "fp8-e2e"):
        trained, metrics = art(Model, tmp_path, f"trained-{recipe}"), art(Metrics, tmp_path, f"rl-{recipe}")
        run_id = rl_step.python_func(
            model=model, mlflow_run=tracking, recipe=recipe, steps=1, pipeline_name="p", kfp_run_id=KFP_RUN,
            trained=trained, metrics=metrics, backend="process", **common,
        )  # fmt: skip
        assert (tmp_path / f"trained-{recipe}" / "model.safetensors").is_file()
        assert {"summary/final_accuracy", "summary/mean_token_mult_prob_error"} <= set(metrics.metadata)
        assert trained.metadata["mlflow_run_id"] == run_id
        ev = art(Metrics, tmp_path, f"ev-{recipe}")
        evaluate.python_func(
            model=trained, mlflow_run=tracking, run_id=run_id, recipe=recipe, metrics=ev, device="cpu", **common
        )
        assert 0 <= ev.metadata["evaluate/accuracy"] <= 1
        bm = art(Metrics, tmp_path, f"bench-{recipe}")
        same = benchmark.python_func(
            model=trained, mlflow_run=tracking, recipe=recipe, pipeline_name="p", kfp_run_id=KFP_RUN, metrics=bm,
            run_id=run_id, steps=1, warmup_steps=0, device="cpu", **common,
        )  # fmt: skip
        assert same == run_id and bm.metadata["bench/rollout_tokens_per_s"] > 0 and "device_name" in bm.metadata
        run_ids.append(run_id)

    client = MlflowClient(ref.tracking_uri)
    for run_id in run_ids:
        run = client.get_run(run_id)
        assert run.data.tags["mlflow.parentRunId"] == ref.run_id
        assert run.data.tags[TAG_KFP_RUN_ID] == KFP_RUN and run.data.tags[TAG_KFP_COMPONENT] == "rl-step"
        assert {"evaluate/accuracy", "bench/train_tokens_per_s", "summary/final_accuracy"} <= set(run.data.metrics)
        # the comparison's step time: the median of the RL steps' (fp8rl.tracking.vocabulary)
        steps = sorted(m.value for m in client.get_metric_history(run_id, "time/step_s"))
        assert run.data.metrics["summary/step_s"] == pytest.approx(statistics.median(steps)) and len(steps) == 1
        # the data it trained and was evaluated on, as MLflow dataset inputs: the same for both recipes
        inputs = {t.value: d.dataset for d in run.inputs.dataset_inputs for t in d.tags}
        assert {k: v.name for k, v in inputs.items()} == {
            "training": "arithmetic-train",
            "evaluation": "arithmetic-test",
        }
        assert json.loads(inputs["evaluation"].source)["tags"]["eval_examples"] == str(RUN_CONFIG["eval_examples"])
    digests = [{d.dataset.digest for d in client.get_run(r).inputs.dataset_inputs} for r in run_ids]
    assert digests[0] == digests[1] and len(digests[0]) == 2

    conversion = art(Markdown, tmp_path, "conversion.md")
    (tmp_path / "conversion.md").write_text("# FP8 conversion report\n")
    report, page = art(Markdown, tmp_path, "report.md"), art(HTML, tmp_path, "report.html")
    compare_recipes.python_func(
        mlflow_run=tracking, run_ids=run_ids, conversion_report=conversion, pipeline_name="p", kfp_run_id=KFP_RUN,
        report=report, report_html=page,
    )  # fmt: skip
    text = (tmp_path / "report.md").read_text()
    assert "| bf16 |" in text and "| fp8-e2e |" in text and "# FP8 conversion report" in text
    assert "data:image/png;base64," in (tmp_path / "report.html").read_text()
    assert report.metadata["table"] in text and report.metadata["mlflow_run_id"] == ref.run_id
    parent = client.get_run(ref.run_id)
    assert parent.info.status == "FINISHED"  # the comparison ends the parent run
    artifacts = {a.path for a in client.list_artifacts(ref.run_id)}
    assert {"comparison.md", "comparison.html", "plots"} <= artifacts


def test_benchmark_without_a_run_makes_a_child_run(
    tracking: Artifact, tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    ref = read_run_ref(tracking)
    model = art(Model, tmp_path, "model")
    shutil.copytree(tiny_models["tiny"], tmp_path / "model")
    run_id = benchmark.python_func(
        model=model, mlflow_run=tracking, recipe="fp8-rollout", seed=0, run_config=RUN_CONFIG, pipeline_name="bench",
        kfp_run_id=KFP_RUN, metrics=art(Metrics, tmp_path, "m"), steps=1, warmup_steps=0, device="cpu",
        profile_train=True,
    )  # fmt: skip
    run = MlflowClient(ref.tracking_uri).get_run(run_id)
    assert run.info.run_name == "fp8-rollout-benchmark" and run.info.status == "FINISHED"
    assert run.data.tags["recipe"] == "fp8-rollout" and run.data.tags[TAG_KFP_COMPONENT] == "benchmark"
    assert run.data.tags["mlflow.parentRunId"] == ref.run_id and "bench/sync_s" in run.data.metrics
    assert run.data.metrics["bench/train_device_ms/gemm"] > 0  # profile_train: the extra step's kernel time
    # a benchmark's own run carries the comparison's throughput keys (fp8rl.tracking.vocabulary), its medians
    for key in ("step_s", "rollout_tokens_per_s", "train_tokens_per_s"):
        assert run.data.metrics[f"summary/{key}"] == run.data.metrics[f"bench/{key}"] > 0
    assert run.data.tags["seed"] == "0"


def test_rl_step_refuses_an_unknown_backend(tracking: Artifact, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"backend: expected one of \['local', 'process', 'rayjob'\], got 'slurm'"):
        rl_step.python_func(
            model=art(Model, tmp_path, "m"), mlflow_run=tracking, recipe="bf16", steps=1, seed=0, run_config={},
            pipeline_name="p", kfp_run_id="r", trained=art(Model, tmp_path, "t"), metrics=art(Metrics, tmp_path, "x"),
            backend="slurm",
        )  # fmt: skip


def test_rl_step_process_backend_refuses_ray_settings(tracking: Artifact, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="run_config.ray: backend 'process' runs without Ray"):
        rl_step.python_func(
            model=art(Model, tmp_path, "m"), mlflow_run=tracking, recipe="bf16", steps=1, seed=0,
            run_config={"ray": {"trainer_workers": 1}}, pipeline_name="p", kfp_run_id="r",
            trained=art(Model, tmp_path, "t"), metrics=art(Metrics, tmp_path, "x"), backend="process",
        )  # fmt: skip


def _recipe_run(ref: MlflowRunRef, recipe: str, seed: int) -> str:
    from fp8rl.tracking import MlflowSink, recipe_tags

    sink = MlflowSink(
        ref.experiment, f"{recipe}-s{seed}", ref.work_dir, ref.run_id, {**recipe_tags(recipe), "seed": str(seed)}
    )
    return sink.run_id


@pytest.mark.parametrize(
    ("error", "status"), [(RuntimeError("the RayJob failed"), "FAILED"), (SystemExit(143), "KILLED")]
)
def test_a_failing_step_ends_its_runs_and_the_comparison_run(
    tracking: Artifact, error: BaseException, status: str
) -> None:
    """A step's error ends the comparison run and this recipe's RUNNING runs (FAILED, or KILLED when the pod was
    terminated), tagged with the step; another recipe's run, still training, stays RUNNING; the error goes on."""
    ref = read_run_ref(tracking)
    mine, other_seed, other = (
        _recipe_run(ref, "fp8-e2e", 0),
        _recipe_run(ref, "fp8-e2e", 1),
        _recipe_run(ref, "bf16", 0),
    )
    with pytest.raises(type(error)), runs_fail_with_the_step(ref, "rl-step", "fp8-e2e", 0):
        raise error
    client = MlflowClient(tracking_uri=ref.tracking_uri)
    for run_id in (ref.run_id, mine):
        run = client.get_run(run_id)
        assert run.info.status == status and run.data.tags[TAG_FAILED_STEP] == "rl-step", run_id
    assert "the RayJob failed" in client.get_run(mine).data.tags["fp8rl.error"] or status == "KILLED"
    assert client.get_run(other).info.status == client.get_run(other_seed).info.status == "RUNNING"


def test_a_step_that_succeeds_leaves_the_runs_running(tracking: Artifact) -> None:
    ref = read_run_ref(tracking)
    mine = _recipe_run(ref, "bf16", 0)
    with runs_fail_with_the_step(ref, "evaluate", "bf16", 0):
        pass
    client = MlflowClient(tracking_uri=ref.tracking_uri)
    assert client.get_run(mine).info.status == client.get_run(ref.run_id).info.status == "RUNNING"


@pytest.mark.parametrize(
    ("kfp_state", "status"), [("FAILED", "FAILED"), ("CANCELLED", "KILLED"), ("SUCCEEDED", "FINISHED")]
)
def test_the_exit_task_ends_the_kfp_runs_mlflow_runs_as_the_pipeline_ended(
    tracking: Artifact, kfp_state: str, status: str
) -> None:
    """The pipeline's exit task (``finish_tracking``) ends every run of its KFP run still RUNNING (a step killed
    outright never could) as the pipeline ended; a run a step already ended keeps its status, and another KFP
    run's runs are left alone."""
    from kfp import dsl

    from components.tracking import finish_tracking
    from fp8rl.tracking import MlflowSink

    ref = read_run_ref(tracking)
    tags = {TAG_KFP_RUN_ID: KFP_RUN}
    killed = MlflowSink(ref.experiment, "bf16-rl", ref.work_dir, ref.run_id, tags).run_id
    done = MlflowSink(ref.experiment, "fp8-e2e-rl", ref.work_dir, ref.run_id, tags)
    done.close("FINISHED")
    other = MlflowSink(ref.experiment, "another", ref.work_dir, tags={TAG_KFP_RUN_ID: "another-kfp-run"}).run_id
    final = dsl.PipelineTaskFinalStatus(
        state=kfp_state, pipeline_job_resource_name="r", pipeline_task_name="exit-handler-1",
        error_code=None if kfp_state == "SUCCEEDED" else 1, error_message="" if kfp_state == "SUCCEEDED" else "boom",
    )  # fmt: skip
    finish_tracking.python_func(experiment=ref.experiment, work_dir=ref.work_dir, kfp_run_id=KFP_RUN, status=final)
    client = MlflowClient(tracking_uri=ref.tracking_uri)
    for run_id in (ref.run_id, killed):
        run = client.get_run(run_id)
        assert run.info.status == status and run.data.tags["fp8rl.ended_by"] == "exit-handler", run_id
        assert run.data.tags["fp8rl.kfp_state"] == kfp_state
        assert ("fp8rl.error" in run.data.tags) is (status != "FINISHED")
    if status != "FINISHED":
        assert client.get_run(killed).data.tags["fp8rl.error"] == "exit-handler-1: boom"
    assert client.get_run(done.run_id).info.status == "FINISHED"
    assert "fp8rl.ended_by" not in client.get_run(done.run_id).data.tags
    assert client.get_run(other).info.status == "RUNNING"


def test_the_exit_task_without_a_started_experiment_ends_nothing(tmp_path: Path) -> None:
    from components.runtime import end_kfp_run_runs

    assert end_kfp_run_runs(str(tmp_path / "work"), "never-started", KFP_RUN, "FAILED", "prepare-model: boom") == []


# ---------------------------------------------------------------- RayJob backend


TEMPLATE = {
    "image": "fp8rl-runtime:0.1.0",
    "head": {"resources": {"requests": {"cpu": "1", "memory": "2Gi"}}},
    "workers": {"replicas": 1, "gpusPerWorker": 1, "resources": {"requests": {"cpu": "4", "memory": "16Gi"}}},
    "pvcName": "rl-fp8rl-data",
}


def run_entrypoint_here(doc: dict[str, Any], api: object, timeout_s: float) -> None:
    """Stand-in for submit_rayjob: run the RayJob's entrypoint (``fp8rl train ...``) in a subprocess here."""
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:2] == ["fp8rl", "train"]
    subprocess.run([sys.executable, "-m", "fp8rl", *argv[1:]], check=True, capture_output=True, timeout=timeout_s)


def test_rayjob_backend_runs_the_cli_contract(
    tracking: Artifact, tmp_path: Path, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = read_run_ref(tracking)
    template = tmp_path / "rayjob.yaml"
    template.write_text(yaml.safe_dump(TEMPLATE))
    monkeypatch.setattr(rayjob_backend, "current_namespace", lambda: "team-ns")
    submitted: list[dict[str, Any]] = []

    def submit(doc: dict[str, Any], api: object, timeout_s: float) -> None:
        submitted.append(doc)
        run_entrypoint_here(doc, api, timeout_s)

    # the user's task files and reward live where only the step's pod sees them: the job must get copies
    user = tmp_path / "user"
    user.mkdir()
    for name in ("sums-train.jsonl", "sums-test.jsonl"):
        shutil.copy(DOCS / "data" / name, user / name)
    shutil.copy(DOCS / "examples" / "reward_last_number.py", user / "reward.py")
    inputs = {
        "task": {"type": "jsonl", "train": str(user / "sums-train.jsonl"), "test": str(user / "sums-test.jsonl")},
        "reward": {"type": "python", "function": f"{user / 'reward.py'}:score"},
    }

    def submit_elsewhere(doc: dict[str, Any], api: object, timeout_s: float) -> None:
        shutil.rmtree(user)  # the Ray pods cannot read the step pod's files
        submit(doc, api, timeout_s)

    cfg = run_config("fp8-e2e", 1, 0, {**RUN_CONFIG, **inputs}, ref)
    tags = {TAG_KFP_RUN_ID: KFP_RUN, TAG_KFP_COMPONENT: "rl-step"}
    out = tmp_path / "trained"
    run_id = rayjob_backend.run_rl_step_as_rayjob(
        cfg, tiny_models["tiny"], out, ref.run_id, tags, template, 600, api=object(), submit=submit_elsewhere
    )
    (doc,) = submitted
    assert doc["kind"] == "RayJob" and doc["metadata"]["namespace"] == "team-ns"
    assert doc["metadata"]["name"] == rayjob_backend.rayjob_name("fp8-e2e", 0, KFP_RUN)
    assert doc["metadata"]["labels"]["fp8rl/kfp-run-id"] == KFP_RUN
    stage = Path(cfg.work_dir) / "kfp-runs" / KFP_RUN / "fp8-e2e-seed0"
    assert f"--model {stage / 'model'}" in doc["spec"]["entrypoint"]
    assert f"--parent-run-id {ref.run_id}" in doc["spec"]["entrypoint"]
    assert "--checkpoint-dir /" in doc["spec"]["entrypoint"]  # on the shared volume: a driver resumes from it
    staged = yaml.safe_load((stage / "run-config.yaml").read_text())
    assert staged["task"]["train"] == str(stage / "inputs" / "train-sums-train.jsonl")
    assert staged["reward"]["function"] == f"{stage / 'inputs' / 'reward-reward.py'}:score"
    assert (stage / "inputs" / "test-sums-test.jsonl").read_bytes() == (DOCS / "data" / "sums-test.jsonl").read_bytes()
    assert (out / "model.safetensors").is_file()
    run = MlflowClient(ref.tracking_uri).get_run(run_id)
    assert run.data.tags["mlflow.parentRunId"] == ref.run_id and run.data.tags["recipe"] == "fp8-e2e"
    assert run.data.tags[TAG_KFP_RUN_ID] == KFP_RUN and "summary/final_accuracy" in run.data.metrics
    assert run.data.params["task.type"] == "jsonl" and run.data.params["reward.type"] == "python"
    assert run.data.metrics["reward/errors"] == 0
    # the user's files as the run's dataset inputs: where the run read them, their size and a digest of the content
    inputs = {t.value: d.dataset for d in run.inputs.dataset_inputs for t in d.tags}
    assert inputs["training"].source_type == "local" and inputs["training"].name == "train-sums-train.jsonl"
    assert json.loads(inputs["training"].source) == {"uri": staged["task"]["train"]}
    rows = sum(1 for line in (DOCS / "data" / "sums-train.jsonl").read_text().splitlines() if line.strip())
    assert json.loads(inputs["training"].profile) == {"num_rows": rows}
    assert inputs["evaluation"].digest != inputs["training"].digest


def test_rayjob_backend_runs_on_the_standing_cluster_the_template_names(
    tracking: Artifact, tmp_path: Path, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart with ray.enabled names its RayCluster in rayjob.yaml: the RayJob selects it instead of bringing a
    cluster of its own, and is still owned by the step's pod."""
    template = tmp_path / "rayjob.yaml"
    template.write_text(yaml.safe_dump({**TEMPLATE, "rayClusterName": "rl-fp8rl-ray"}))
    monkeypatch.setattr(rayjob_backend, "current_namespace", lambda: "team-ns")
    monkeypatch.setenv("FP8RL_POD_NAME", "rl-step-pod")
    monkeypatch.setenv("FP8RL_POD_UID", "0000-1111")
    submitted: list[dict[str, Any]] = []

    def submit(doc: dict[str, Any], api: object, timeout_s: float) -> None:
        submitted.append(doc)
        raise RuntimeError("stop here")

    cfg = run_config("bf16", 1, 0, {}, read_run_ref(tracking))
    with pytest.raises(RuntimeError, match="stop here"):
        rayjob_backend.run_rl_step_as_rayjob(
            cfg, tiny_models["tiny"], tmp_path / "out", "parent", {}, template, 60, api=object(), submit=submit
        )
    (doc,) = submitted
    assert doc["spec"]["clusterSelector"] == {"ray.io/cluster": "rl-fp8rl-ray"} and "rayClusterSpec" not in doc["spec"]
    assert doc["metadata"]["ownerReferences"][0]["name"] == "rl-step-pod"


def test_rayjob_backend_needs_the_volume(tracking: Artifact, tmp_path: Path) -> None:
    template = tmp_path / "rayjob.yaml"
    template.write_text(yaml.safe_dump({k: v for k, v in TEMPLATE.items() if k != "pvcName"}))
    cfg = run_config("bf16", 1, 0, {}, read_run_ref(tracking))
    with pytest.raises(UserError, match="pvcName is empty"):
        rayjob_backend.run_rl_step_as_rayjob(cfg, tmp_path, tmp_path / "o", "p", {}, template, 1, submit=print)


def test_rayjob_names_are_valid_and_distinct() -> None:
    names = {
        rayjob_backend.rayjob_name(r, s, k) for r in ("fp8-e2e", "My_Recipe.v2" * 6) for s in (0, 1) for k in ("a", "b")
    }
    assert len(names) == 8
    for name in names:
        assert len(name) <= 47 and name[0].isalpha() and all(c.islower() or c.isdigit() or c == "-" for c in name)


def test_diagnose_component_writes_report_and_recommendation(tmp_path: Path) -> None:
    from components.diagnose import diagnose_mismatch

    model = art(Model, tmp_path, "model")
    prepare_model.python_func(source="small", seed=0, model=model)
    report, diagnosis = art(Markdown, tmp_path, "report"), art(Artifact, tmp_path, "diagnosis")
    diagnose_mismatch.python_func(
        model=model, recipe="fp8-rollout", run_config={"sampling": {"max_tokens": 6}}, report=report,
        diagnosis=diagnosis, target=1.5, examples=8, device="cpu",
    )  # fmt: skip
    assert "# FP8 mismatch diagnosis" in Path(report.path).read_text()
    assert (Path(diagnosis.path) / "diagnosis.json").is_file() and (Path(diagnosis.path) / "per_layer.png").is_file()
    assert diagnosis.metadata["bf16_first_layers"] == 0 and diagnosis.metadata["tmpe_all_fp8"] > 1.0
    with pytest.raises(UserError, match="rollout is BF16"):
        diagnose_mismatch.python_func(
            model=model, recipe="bf16", run_config={}, report=report, diagnosis=diagnosis, device="cpu"
        )


def test_comparison_runs_pair_every_recipe_with_every_seed() -> None:
    from components.compare import comparison_runs

    assert comparison_runs.python_func(recipes=["bf16", "fp8-e2e"], seeds=[0, "1"], seed=7) == [
        {"recipe": "bf16", "seed": 0}, {"recipe": "bf16", "seed": 1},
        {"recipe": "fp8-e2e", "seed": 0}, {"recipe": "fp8-e2e", "seed": 1},
    ]  # fmt: skip
    assert comparison_runs.python_func(recipes=["bf16"], seeds=[], seed=7) == [{"recipe": "bf16", "seed": 7}]
    with pytest.raises(UserError, match="given twice"):
        comparison_runs.python_func(recipes=["bf16"], seeds=[1, 1], seed=0)
    with pytest.raises(UserError, match="at least one recipe"):
        comparison_runs.python_func(recipes=[], seeds=[], seed=0)
