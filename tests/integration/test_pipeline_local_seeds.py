"""``recipe-comparison`` with several seeds under kfp.local: one RL step, evaluation and benchmark per recipe and
seed. A file of its own so that ``make test`` runs it in the main pytest process (scripts/pytest_tiers.sh), beside
tests/integration/test_pipeline_local.py in the other.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipelines.submit import main

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")]


def test_recipe_comparison_runs_every_recipe_with_every_seed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``seeds``: one RL step, evaluation and benchmark per recipe and seed, each its own MLflow run under the one
    comparison run, and a row each in the report."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    work = tmp_path / "work"
    params = ["recipes=[bf16]", "seeds=[0, 1]", "sft_steps=0", "rl_steps=1", "bench_steps=1",
              "run_config={grpo: {prompts_per_step: 2, group_size: 2}, eval_examples: 4, eval_samples: 0}"]  # fmt: skip
    assert (
        main(["recipe-comparison", "--local", "--work-dir", str(work), *(a for p in params for a in ("--param", p))])
        == 0
    )
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    exp = client.get_experiment_by_name("fp8rl")
    (parent,) = client.search_runs([exp.experiment_id], "tags.`fp8rl.comparison` = 'true'")
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    runs = {c.info.run_name: c for c in children if "recipe" in c.data.tags}
    assert sorted(runs) == ["bf16-seed0", "bf16-seed1"] and all(c.info.status == "FINISHED" for c in runs.values())
    assert {c.data.tags["seed"] for c in runs.values()} == {"0", "1"}
    assert all("bench/step_s" in c.data.metrics and "evaluate/accuracy" in c.data.metrics for c in runs.values())
    report = Path(client.download_artifacts(parent.info.run_id, "comparison.md", str(tmp_path / "dl"))).read_text()
    assert "| bf16-seed0 |" in report and "| bf16-seed1 |" in report
