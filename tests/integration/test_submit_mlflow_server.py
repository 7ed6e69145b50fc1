"""A pipeline run locally while tracking goes over HTTP to a real ``mlflow server`` on loopback.

The cluster case in small: every kfp.local step is a separate process that reaches MLflow only
through ``$MLFLOW_TRACKING_URI`` (as the pods get it from the chart's ConfigMap), and the
artifacts (the comparison report, the plots) travel through the server's artifact proxy.
``fp8-benchmark`` is the cheapest pipeline with a fan-out: no SFT, no RL.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow_serving import serve_mlflow

from pipelines.submit import main

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")]


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """``mlflow server`` with a SQLite store and proxied artifacts, started here and stopped (its group) after."""
    with serve_mlflow(tmp_path / "server") as url:
        yield url


def test_benchmark_pipeline_tracks_over_http(
    mlflow_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    work = tmp_path / "work"
    argv = ["fp8-benchmark", "--local", "--work-dir", str(work), "--param", "recipes=bf16,fp8-e2e"]
    argv += ["--param", "bench_steps=1", "--param", "warmup_steps=0", "--param", "experiment=bench-http"]
    argv += ["--param", "run_config={grpo: {prompts_per_step: 2, group_size: 2}}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(f"open the runs: {mlflow_server}")
    assert not (work / "mlflow.db").exists()  # nothing tracked on the side

    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("bench-http")
    (parent,) = client.search_runs([exp.experiment_id], "tags.`fp8rl.comparison` = 'true'")
    assert parent.info.status == "FINISHED" and parent.data.tags["kfp.pipeline"] == "fp8-benchmark"
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.info.run_name for c in children) == ["bf16-benchmark", "fp8-e2e-benchmark"]
    for child in children:
        assert child.data.tags["kfp.run_id"] == parent.data.tags["kfp.run_id"]
        assert child.data.metrics["bench/sync_bytes"] > 0 and child.data.metrics["bench/train_tokens_per_s"] > 0
    fp8, bf16 = sorted(children, key=lambda c: c.info.run_name, reverse=True)
    assert fp8.data.metrics["bench/sync_bytes"] < bf16.data.metrics["bench/sync_bytes"]  # FP8 syncs fewer bytes
    report = Path(client.download_artifacts(parent.info.run_id, "comparison.md", str(tmp_path / "dl")))
    text = report.read_text()
    assert "| bf16 |" in text and "| fp8-e2e |" in text and mlflow_server in text and "FP8 conversion report" in text
