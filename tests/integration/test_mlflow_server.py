"""fp8rl.tracking against a real ``mlflow server`` subprocess, as the cluster runs it.

The server proxies artifacts (``--serve-artifacts``), so a recipe run's files travel over
HTTP into ``--artifacts-destination``; everything is read back through the REST API.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow_serving import serve_mlflow

from fp8rl.tracking import (
    TOKEN_MULT_PROB_ERROR,
    MlflowSink,
    comparison_table,
    fetch_recipe_runs,
    plot_metric_history,
    recipe_tags,
    start_parent_run,
)

EXPERIMENT = "fp8rl-compare"


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """``mlflow server`` with a SQLite store and proxied artifacts, started here and stopped (its group) after."""
    with serve_mlflow(tmp_path / "server") as url:
        yield url


def test_recipe_runs_round_trip_through_a_tracking_server(
    mlflow_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    work = tmp_path / "work"
    slopes = {"bf16": 0.10, "fp8-e2e": 0.09}

    parent_id = start_parent_run(EXPERIMENT, "compare", work, tags={"suite": "integration"})
    for recipe, slope in slopes.items():
        report = tmp_path / f"{recipe}.md"
        report.write_text(f"# {recipe}\n")
        with MlflowSink(EXPERIMENT, recipe, work, parent_run_id=parent_id, tags=recipe_tags(recipe)) as sink:
            sink.log_params({**recipe_tags(recipe), "optim": {"lr": 1e-6}})
            for step in range(5):
                sink.log_metrics({"reward": slope * step, TOKEN_MULT_PROB_ERROR: 1.0 + step / 100}, step)
            sink.log_metrics({"grad_norm": float("nan")}, step=5)  # non-finite values go as-is
            sink.log_artifact(report, "reports")

    runs = fetch_recipe_runs(EXPERIMENT, parent_id, mlflow_server)
    assert [r.recipe for r in runs] == ["bf16", "fp8-e2e"]
    assert [r.final("reward") for r in runs] == [pytest.approx(0.4), pytest.approx(0.36)]
    assert all(math.isnan(r.final("grad_norm") or 0.0) for r in runs)
    table = comparison_table(runs, ["reward"])
    assert (
        "| bf16 | bf16 | FINISHED | 0.4 | 1.02 |" in table and "| fp8-e2e | fp8-e2e | FINISHED | 0.36 | 1.02 |" in table
    )

    plot = plot_metric_history({r.recipe: r.histories["reward"] for r in runs}, "reward", tmp_path / "reward.png")
    with MlflowSink.attach(parent_id, work) as parent:
        parent.log_artifact(plot, "comparison")

    client = MlflowClient(tracking_uri=mlflow_server)
    assert client.get_run(parent_id).info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(parent_id, "comparison")] == ["comparison/reward.png"]
    experiment_id = client.get_experiment_by_name(EXPERIMENT).experiment_id
    children = client.search_runs([experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert sorted(r.data.params["recipe"] for r in children) == ["bf16", "fp8-e2e"]
    for child in children:
        steps = sorted(m.step for m in client.get_metric_history(child.info.run_id, "reward"))
        assert steps == [0, 1, 2, 3, 4]
        assert child.info.artifact_uri.startswith("mlflow-artifacts:")
        assert [a.path for a in client.list_artifacts(child.info.run_id, "reports")] == [
            f"reports/{child.data.tags['recipe']}.md"
        ]
    stored = sorted(p.name for p in (tmp_path / "server" / "artifacts").rglob("*.md"))
    assert stored == ["bf16.md", "fp8-e2e.md"]  # the files went over HTTP to the server's store
    assert not (work / "mlflow.db").exists()
