"""The recipe comparison as an MLflow user reads it, on a real ``mlflow server`` (SQLite store, proxied artifacts):

1. every RL step logs its trained checkpoint as an MLflow model (tagged recipe, FP8 linear counts, held-out
   accuracy), and the comparison registers the best recipe's model under alias ``champion``, whose files
   ``models:/fp8rl-arithmetic@champion`` brings back byte for byte;
2. MLflow's system metrics (CPU, memory) cover the RL, evaluation and benchmark steps of each recipe run;
3. the child runs, read through the search API as MLflow's compare view reads them, carry every comparison key
   (``fp8rl.tracking.vocabulary.COMPARE_KEYS``) for every recipe.

The pipeline's steps run through their components' ``.python_func`` with the tiny model on the CPU (the RL step in
the test's process: ``backend="process"``).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import pytest
from kfp.dsl import HTML, Artifact, Markdown, Metrics, Model
from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus
from mlflow_serving import serve_mlflow

from components.benchmark import benchmark
from components.compare import compare_recipes
from components.evaluate import evaluate
from components.rl_step import rl_step
from components.runtime import read_run_ref
from components.tracking import start_tracking
from fp8rl.tracking.models import CHAMPION_ALIAS, CHAMPION_TAG, COMPARISON_RUN_TAG, MODEL_ID_TAG, download_model
from fp8rl.tracking.system_metrics import CPU_UTILIZATION, MEMORY_USED_MB
from fp8rl.tracking.vocabulary import COMPARE_KEYS
from scripts.mlflow_ui_shots import CHROMIUM, latest_comparison, take_shots

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")

RECIPES = ("bf16", "fp8-e2e")
KFP_RUN = "9e8d7c6b-kfp-run"
# system metrics every 0.1 s: the tiny model's steps last a second or less (MLflow's default interval, 10 s, would log
# none); at 0.5 s a CI machine logged 2 samples over the three steps, fewer than the test asks for
RUN_CONFIG = {
    "grpo": {"prompts_per_step": 2, "group_size": 2},
    "eval_examples": 8,
    "eval_samples": 1,
    "eval_every": 1,
    "tracking": {"system_metrics_interval_s": 0.1},
}


def art(cls: type, tmp: Path, name: str) -> Any:
    return cls(name=name, uri=str(tmp / name), metadata={})


def _recipe_steps(tracking: Artifact, model: Artifact, recipe: str, tmp: Path) -> tuple[str, Path]:
    """RL step -> evaluation -> benchmark of one recipe, as the pipeline chains them; the run id and checkpoint."""
    common: dict[str, Any] = {"recipe": recipe, "seed": 0, "run_config": RUN_CONFIG}
    trained = art(Model, tmp, f"trained-{recipe}")
    run_id = rl_step.python_func(
        model=model, mlflow_run=tracking, steps=2, pipeline_name="p", kfp_run_id=KFP_RUN, trained=trained,
        metrics=art(Metrics, tmp, f"rl-{recipe}"), backend="process", **common,
    )  # fmt: skip
    evaluate.python_func(
        model=trained, mlflow_run=tracking, run_id=run_id, metrics=art(Metrics, tmp, f"ev-{recipe}"), device="cpu",
        **common,
    )  # fmt: skip
    benchmark.python_func(
        model=trained, mlflow_run=tracking, pipeline_name="p", kfp_run_id=KFP_RUN,
        metrics=art(Metrics, tmp, f"bench-{recipe}"), run_id=run_id, steps=1, warmup_steps=0, device="cpu", **common,
    )  # fmt: skip
    return run_id, Path(trained.path)


@dataclass(frozen=True)
class Compared:
    url: str  # the tracking server
    parent_id: str
    checkpoints: dict[str, Path]  # recipe run id -> its trained checkpoint
    report: Markdown
    tmp: Path


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path]) -> Iterator[Compared]:
    """Two recipes through RL step, evaluation and benchmark, then the comparison, on a real tracking server."""
    tmp = tmp_path_factory.mktemp("registry")
    with serve_mlflow(tmp / "server") as url, pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", url)
        tracking = art(Artifact, tmp, "mlflow_run")
        start_tracking.python_func(
            experiment="registry", work_dir=str(tmp / "work"), pipeline_name="p", kfp_run_id=KFP_RUN,
            kfp_run_name="n", mlflow_run=tracking,
        )  # fmt: skip
        model = art(Model, tmp, "model")
        shutil.copytree(tiny_models["tiny"], tmp / "model")
        checkpoints = dict(_recipe_steps(tracking, model, recipe, tmp) for recipe in RECIPES)
        (tmp / "conversion.md").write_text("# FP8 conversion report\n")
        report = art(Markdown, tmp, "report.md")
        compare_recipes.python_func(
            mlflow_run=tracking, run_ids=list(checkpoints), conversion_report=art(Markdown, tmp, "conversion.md"),
            pipeline_name="p", kfp_run_id=KFP_RUN, report=report, report_html=art(HTML, tmp, "report.html"),
        )  # fmt: skip
        yield Compared(url, read_run_ref(tracking).run_id, checkpoints, report, tmp)


def test_models_system_metrics_and_compare_keys_on_a_tracking_server(compared: Compared) -> None:
    url, checkpoints, tmp_path = compared.url, compared.checkpoints, compared.tmp
    client = MlflowClient(tracking_uri=url)
    # 3. the compare view's data: the comparison's child runs through the search API, every key for every recipe
    children = client.search_runs(
        [client.get_run(compared.parent_id).info.experiment_id], f"tags.mlflow.parentRunId = '{compared.parent_id}'"
    )
    assert sorted(r.data.tags["recipe"] for r in children) == sorted(RECIPES)
    for run in children:
        missing = {k for k in COMPARE_KEYS.values() if not math.isfinite(run.data.metrics.get(k, math.nan))}
        assert not missing, f"{run.data.tags['recipe']}: no finite {sorted(missing)}"
        assert run.info.status == "FINISHED"
        _check_system_metrics(client, run.info.run_id)
        _check_logged_model(client, run, checkpoints[run.info.run_id])
    # 1. the champion: the best evaluated accuracy, registered and loadable by its alias
    version = client.get_model_version_by_alias("fp8rl-arithmetic", CHAMPION_ALIAS)
    best = max(r.data.metrics["evaluate/accuracy"] for r in children)
    champ = next(r for r in children if r.info.run_id == version.run_id)
    assert champ.data.metrics["evaluate/accuracy"] == best
    assert (
        version.source == f"models:/{champ.data.tags[MODEL_ID_TAG]}"
        and version.tags[COMPARISON_RUN_TAG] == compared.parent_id
    )
    parent = client.get_run(compared.parent_id)
    assert parent.data.tags[CHAMPION_TAG] == "models:/fp8rl-arithmetic@champion" == compared.report.metadata["champion"]
    loaded = Path(
        mlflow.artifacts.download_artifacts("models:/fp8rl-arithmetic@champion", dst_path=str(tmp_path / "dl"))
    )
    # the same through fp8rl's own command's library call, over HTTP (mlflow-artifacts:/ locations)
    served = download_model(url, "models:/fp8rl-arithmetic@champion", tmp_path / "served")
    for name in ("config.json", "model.safetensors"):
        assert (loaded / name).read_bytes() == (checkpoints[version.run_id] / name).read_bytes(), name
        assert (served / name).read_bytes() == (checkpoints[version.run_id] / name).read_bytes(), name


def _check_system_metrics(client: MlflowClient, run_id: str) -> None:
    """CPU and memory samples over the run's three steps, one step counter (the later steps continue it)."""
    for key in (CPU_UTILIZATION, MEMORY_USED_MB):
        history = client.get_metric_history(run_id, key)
        steps = [m.step for m in history]
        assert len(steps) >= 3 and sorted(steps) == list(range(len(steps))), (key, steps)
    memory = [m.value for m in client.get_metric_history(run_id, MEMORY_USED_MB)]
    assert all(v > 0 for v in memory)
    times = sorted(m.timestamp for m in client.get_metric_history(run_id, CPU_UTILIZATION))
    evaluated = client.get_metric_history(run_id, "evaluate/accuracy")[0].timestamp
    assert times[0] < evaluated <= times[-1] + 1000  # samples from the RL step and from the steps after it


def _check_logged_model(client: MlflowClient, run: Any, checkpoint: Path) -> None:
    model = client.get_logged_model(run.data.tags[MODEL_ID_TAG])
    assert model.source_run_id == run.info.run_id and model.status == LoggedModelStatus.READY
    tags = model.tags
    assert tags["recipe"] == run.data.tags["recipe"]
    assert tags["fp8_linears_engine"] == run.data.params["fp8_linears_engine"]
    assert tags["fp8_linears_trainer"] == run.data.params["fp8_linears_trainer"]
    assert float(tags["heldout_accuracy"]) == pytest.approx(run.data.metrics["summary/final_accuracy"], abs=1e-6)
    if run.data.tags["recipe"] == "fp8-e2e":
        assert int(tags["fp8_linears_trainer"]) > 0 and int(tags["fp8_linears_engine"]) > 0
    stored = {a.path for a in client.list_logged_model_artifacts(model.model_id)}
    assert {"config.json", "model.safetensors"} <= stored, stored
    assert {p.name for p in checkpoint.iterdir() if p.is_file()} <= stored


def test_the_mlflow_ui_shows_the_recipes_side_by_side_and_the_champion(compared: Compared) -> None:
    """The real MLflow UI in headless Chromium (``scripts/mlflow_ui_shots.py``, as ``make mlflow-ui-shots`` runs it
    for docs/images): the compare view of the recipe runs shows every comparison key for both recipes, the
    registered model's page its champion."""
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no Chromium at {CHROMIUM}: scripts/container_tools.sh --ui-only (make mlflow-ui-shots)")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (make mlflow-ui-shots)")
    comparison = latest_comparison(compared.url)
    assert sorted(comparison.run_ids) == sorted(compared.checkpoints) and comparison.recipes == sorted(RECIPES)
    texts = take_shots(compared.url, comparison, compared.tmp / "shots")
    compare = texts["mlflow-compare.png"]
    assert all(key in compare for key in COMPARE_KEYS.values()) and all(r in compare for r in RECIPES)
    assert "fp8rl-arithmetic" in texts["mlflow-champion.png"] and "champion" in texts["mlflow-champion.png"]
    for name in texts:
        png = (compared.tmp / "shots" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 20_000, name
