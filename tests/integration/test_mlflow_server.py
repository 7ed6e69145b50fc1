"""fp8rl.tracking against a real ``mlflow server`` subprocess, as the cluster runs it.

The server proxies artifacts (``--serve-artifacts``), so a recipe run's files travel over
HTTP into ``--artifacts-destination``; everything is read back through the REST API.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient

from fp8rl.tracking import (
    TOKEN_MULT_PROB_ERROR,
    MlflowSink,
    comparison_table,
    fetch_recipe_runs,
    plot_metric_history,
    recipe_tags,
    start_parent_run,
)

MLFLOW = Path(sys.executable).parent / "mlflow"
STARTUP_TIMEOUT_S = 120  # migrations + uvicorn import take ~15 s on 2 busy cores
EXPERIMENT = "fp8rl-compare"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    pytest.fail(f"mlflow server not healthy after {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server (it forwards to its uvicorn child); kill its process group if it hangs."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this test started (start_new_session)
        proc.wait(timeout=10)


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    assert MLFLOW.is_file(), f"no mlflow executable next to {sys.executable}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_dir = tmp_path / "server"
    server_dir.mkdir()
    log = server_dir / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    # No telemetry; no GenAI job runner (seven huey consumer processes this test has no use for).
    env |= {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [
        str(MLFLOW),
        "server",
        "--backend-store-uri",
        f"sqlite:///{server_dir / 'mlflow.db'}",
        "--serve-artifacts",
        "--artifacts-destination",
        str(server_dir / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=server_dir, start_new_session=True
        )
        try:
            wait_until_healthy(url, proc, log)
            yield url
        finally:
            stop(proc)


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
