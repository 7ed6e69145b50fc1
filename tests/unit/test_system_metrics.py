"""MLflow's system metrics on a step's run, and the flag that turns them off (real MLflow on SQLite; the sampler is
MLflow's own, in a thread of this process)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kfp.dsl import Artifact
from mlflow import MlflowClient

from components.runtime import read_run_ref, recipe_run
from components.tracking import start_tracking
from fp8rl.config import TrackingConfig
from fp8rl.tracking.system_metrics import CPU_UTILIZATION, MEMORY_USED_MB

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")


@pytest.fixture(autouse=True)
def local_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_steps_run_samples_cpu_and_memory_unless_turned_off(tmp_path: Path, enabled: bool) -> None:
    """A step working 1.5 s with samples every 0.2 s: CPU and memory samples in its run, none with the flag off;
    a second step on the same run continues the sampler's step counter."""
    tracking = Artifact(name="mlflow_run", uri=str(tmp_path / "mlflow_run"), metadata={})
    start_tracking.python_func(
        experiment="sysm", work_dir=str(tmp_path / "work"), pipeline_name="p", kfp_run_id="k", kfp_run_name="n",
        mlflow_run=tracking,
    )  # fmt: skip
    ref = read_run_ref(tracking)
    cfg = TrackingConfig(system_metrics=enabled, system_metrics_interval_s=0.2)
    with recipe_run(ref, "", "bf16", 0, {}, cfg) as run:
        time.sleep(1.5)
    client = MlflowClient(ref.tracking_uri)
    first = [m.step for m in client.get_metric_history(run.run_id, CPU_UTILIZATION)]
    with recipe_run(ref, run.run_id, "bf16", 0, {}, cfg):  # the evaluation after the RL step: the run reopened
        time.sleep(1.0)
    steps = sorted(m.step for m in client.get_metric_history(run.run_id, CPU_UTILIZATION))
    memory = client.get_metric_history(run.run_id, MEMORY_USED_MB)
    assert client.get_run(run.run_id).info.status == "FINISHED"
    if not enabled:
        assert steps == [] and memory == []
        return
    assert len(first) >= 3 and len(steps) > len(first) and steps == list(range(len(steps)))
    assert all(m.value > 0 for m in memory)
