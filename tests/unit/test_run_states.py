"""A run's end state is final: once a step ended the comparison run FAILED or KILLED, a later step does not turn it
FINISHED; a run of a custom recipe file (tagged with the recipe's name, not the file's path) is ended like any
other.  Real MLflow on SQLite, the components called through ``.python_func``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kfp.dsl import HTML, Artifact, Markdown
from mlflow import MlflowClient

from components.compare import compare_recipes
from components.runtime import TAG_FAILED_STEP, read_run_ref, recipe_run, runs_fail_with_the_step
from components.tracking import start_tracking
from fp8rl.config import TrackingConfig
from fp8rl.config.recipe import RECIPE_DIR
from fp8rl.tracking import MlflowSink, recipe_tags

KFP_RUN = "5a6b7c8d-kfp-run"


def art(cls: type, tmp: Path, name: str) -> Any:
    return cls(name=name, uri=str(tmp / name), metadata={})


@pytest.fixture(autouse=True)
def local_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture
def tracking(tmp_path: Path) -> Artifact:
    run = art(Artifact, tmp_path, "mlflow_run")
    start_tracking.python_func(
        experiment="states", work_dir=str(tmp_path / "work"), pipeline_name="p", kfp_run_id=KFP_RUN,
        kfp_run_name="n", mlflow_run=run,
    )  # fmt: skip
    return run


def _recipe_run(tracking: Artifact, recipe: str) -> str:
    ref = read_run_ref(tracking)
    sink = MlflowSink(ref.experiment, f"{recipe}-seed0", ref.work_dir, ref.run_id, {**recipe_tags(recipe), "seed": "0"})
    sink.log_metrics({"summary/final_accuracy": 0.5, "summary/mean_token_mult_prob_error": 1.01}, step=1)
    return sink.run_id


def _custom_recipe(tmp_path: Path) -> Path:
    """A recipe file whose name (``my-fp8``) is not its path, as a user writes one."""
    recipe = yaml.safe_load((RECIPE_DIR / "fp8-e2e.yaml").read_text()) | {"name": "my-fp8"}
    path = tmp_path / "recipes" / "mine.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_compare_after_a_failed_step_keeps_the_comparison_run_failed(tracking: Artifact, tmp_path: Path) -> None:
    """A step fails (here the advisory diagnosis, which runs beside the recipes, so the comparison still runs):
    the comparison run ends FAILED; the compare step then logs its report but leaves the run FAILED."""
    ref = read_run_ref(tracking)
    run_id = _recipe_run(tracking, "bf16")
    with pytest.raises(RuntimeError), runs_fail_with_the_step(ref, "diagnose-mismatch"):
        raise RuntimeError("out of memory")
    client = MlflowClient(ref.tracking_uri)
    assert client.get_run(ref.run_id).info.status == "FAILED"

    conversion = art(Markdown, tmp_path, "conversion.md")
    (tmp_path / "conversion.md").write_text("# FP8 conversion report\n")
    report, page = art(Markdown, tmp_path, "report.md"), art(HTML, tmp_path, "report.html")
    compare_recipes.python_func(
        mlflow_run=tracking, run_ids=[run_id], conversion_report=conversion, pipeline_name="p", kfp_run_id=KFP_RUN,
        report=report, report_html=page,
    )  # fmt: skip
    parent = client.get_run(ref.run_id)
    assert parent.info.status == "FAILED" and parent.data.tags[TAG_FAILED_STEP] == "diagnose-mismatch"
    assert "comparison.md" in {a.path for a in client.list_artifacts(ref.run_id)}  # the report is still there


def test_a_failing_step_ends_a_custom_recipe_files_run(tracking: Artifact, tmp_path: Path) -> None:
    """The step is given the recipe's file; its run is tagged with the recipe's name: the failure ends it."""
    ref = read_run_ref(tracking)
    path = _custom_recipe(tmp_path)
    mine = _recipe_run(tracking, "my-fp8")
    with pytest.raises(RuntimeError), runs_fail_with_the_step(ref, "rl-step", str(path), 0):
        raise RuntimeError("the RayJob failed")
    run = MlflowClient(ref.tracking_uri).get_run(mine)
    assert run.info.status == "FAILED" and run.data.tags[TAG_FAILED_STEP] == "rl-step"


def test_a_step_of_a_custom_recipe_file_tags_its_new_run_with_the_recipes_name(
    tracking: Artifact, tmp_path: Path
) -> None:
    """A benchmark without an RL run of its own makes one: tagged ``recipe=my-fp8``, as the RL step's runs are, so
    the comparison's rows and the failure handler find it by the same name."""
    ref = read_run_ref(tracking)
    with recipe_run(ref, "", str(_custom_recipe(tmp_path)), 0, {}, TrackingConfig(system_metrics=False)) as sink:
        sink.log_metrics({"bench/step_s": 1.0}, step=0)
    run = MlflowClient(ref.tracking_uri).get_run(sink.run_id)
    assert run.data.tags["recipe"] == run.data.params["recipe"] == "my-fp8"
    assert run.info.run_name == "my-fp8-step" and run.data.tags["seed"] == "0" and run.info.status == "FINISHED"
