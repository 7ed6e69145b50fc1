"""``recipe-comparison`` end to end with kfp.local, as ``python -m pipelines.submit recipe-comparison --local`` runs it.

Every step is the real component, run by kfp.local's SubprocessRunner in this environment, with a
small budget (SFT 20 steps, 2 RL steps per recipe on 4 prompts x 4 samples, 1 benchmark step).
Checked afterwards against the MLflow store the steps wrote: one comparison run with one child
run per recipe, tagged with the KFP run, each with RL, evaluation and benchmark metrics, and the
report logged on the comparison run, which ends FINISHED.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipelines.submit import main

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")]

BUDGET = [
    "sft_steps=20",
    "rl_steps=2",
    "bench_steps=1",
    "run_config={grpo: {prompts_per_step: 4, group_size: 4}, eval_examples: 16, eval_samples: 1, eval_every: 2}",
    "diagnose=true",  # the optional mismatch diagnosis runs too
]


CHAMPION = "models:/fp8rl-arithmetic@champion"


def test_recipe_comparison_runs_locally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("KF_PIPELINES_ENDPOINT", raising=False)
    work = tmp_path / "work"
    params = [a for p in BUDGET for a in ("--param", p)]
    assert main(["recipe-comparison", "--local", "--work-dir", str(work), *params]) == 0
    out = capsys.readouterr().out

    uri = f"sqlite:///{work / 'mlflow.db'}"
    assert f"\nopen the runs: mlflow ui --backend-store-uri {uri}\n" in out
    # last, the best recipe's registered model and how to load and serve it
    assert f"the best recipe's model: {CHAMPION}\n" in out and f"mlflow artifacts download -u {CHAMPION}" in out
    assert out.rstrip().endswith("vllm serve champion-model   (a Hugging Face checkpoint directory)")
    assert "Got executor_input" not in out  # kfp.local's JSON dumps go to the log file only
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in table[1:]] == ["| bf16", "| fp8-e2e", "| fp8-rollout"]
    assert all(" n/a " not in row for row in table[1:])  # RL, evaluation and benchmark all reached every row

    client = MlflowClient(uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "fp8rl"]
    (parent,) = client.search_runs([exp.experiment_id], "tags.`fp8rl.comparison` = 'true'")
    assert parent.info.status == "FINISHED"
    kfp_run_id = parent.data.tags["kfp.run_id"]
    assert parent.data.tags["kfp.pipeline"] == "recipe-comparison" and kfp_run_id
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"comparison.md", "comparison.html", "plots"}
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    (sft,) = [c for c in children if c.data.tags["kfp.component"] == "sft-warmup"]
    assert sft.info.status == "FINISHED" and sft.data.params["sft.steps"] == "20"
    children = [c for c in children if c is not sft]
    assert sorted(c.data.tags["recipe"] for c in children) == ["bf16", "fp8-e2e", "fp8-rollout"]
    for child in children:
        assert child.data.tags["kfp.run_id"] == kfp_run_id and child.data.tags["kfp.component"] == "rl-step"
        assert {"summary/final_accuracy", "evaluate/accuracy", "bench/rollout_tokens_per_s"} <= set(child.data.metrics)
        # the RL step ran on a local Ray (backend=local's default): one trainer and one rollout worker
        assert child.data.params["ray.trainer_workers"] == "1" and child.data.params["ray.layout"] == "split"
        # back from MLflow to KFP: the run id finds the same runs
    by_tag = client.search_runs([exp.experiment_id], f"tags.`kfp.run_id` = '{kfp_run_id}'")
    assert len(by_tag) == 5 and all(r.info.status == "FINISHED" for r in by_tag)
    assert not any("fp8rl.ended_by" in r.data.tags for r in by_tag)  # every step ended its own run
    champion = client.get_model_version_by_alias("fp8rl-arithmetic", "champion")
    assert champion.run_id in {c.info.run_id for c in children} and parent.data.tags["fp8rl.champion"] == CHAMPION

    logs = list((work / "kfp-local").glob("recipe-comparison-*.log"))
    assert len(logs) == 1 and "Got executor_input" in logs[0].read_text()
    assert logs[0].read_text().count("started a local Ray") == 3  # one per RL step
    (diagnosis,) = (work / "kfp-local").rglob("diagnosis.json")
    per_layer = json.loads(diagnosis.read_text())
    assert len(per_layer["per_layer"]) == 2 and per_layer["tmpe_all_fp8"] >= 1.0  # the tiny preset: 2 layers
    assert (diagnosis.parent / "diagnosis.md").is_file()


def test_a_failed_run_ends_its_mlflow_runs_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step that is not tracked fails after the comparison run started (here the FP8 conversion, given a recipe
    file that does not exist): the pipeline's exit task still runs and ends the comparison run FAILED, where it
    used to stay RUNNING; the submit tool exits non-zero naming the failed step."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("KF_PIPELINES_ENDPOINT", raising=False)
    work = tmp_path / "work"
    params = ["recipe=/no/such/recipe.yaml", "sft_steps=0", "rl_steps=1", "bench_steps=1"]
    assert main(["fp8-rl", "--local", "--work-dir", str(work), *(a for p in params for a in ("--param", p))]) == 1
    err = capsys.readouterr().err
    assert "convert-to-fp8" in err, err

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    (exp,) = [e for e in client.search_experiments() if e.name == "fp8rl"]
    (parent,) = client.search_runs([exp.experiment_id], "tags.`fp8rl.comparison` = 'true'")
    assert parent.info.status == "FAILED", parent.info
    assert parent.data.tags["fp8rl.ended_by"] == "exit-handler" and parent.data.tags["fp8rl.kfp_state"] == "FAILED"


def test_the_benchmark_pipeline_runs_a_bench_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fp8-benchmark`` with ``preset=llama-1b-1gpu``: the recipe list comes from a step's output (the loop
    iterates it), the preset's batch settings reach the benchmark (EOS ignored: every response is ``max_tokens``
    long), and ``run_config`` overrides the rest (the torch engine, a tiny batch and model, for this CPU)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    work = tmp_path / "work"
    params = ["preset=llama-1b-1gpu", "model_source=tiny", "recipes=bf16", "bench_steps=1", "warmup_steps=0",
              "run_config={rollout: {engine: torch}, grpo: {prompts_per_step: 2, group_size: 4}, "
              "sampling: {max_tokens: 48}, optim: {micro_batch_tokens: 512}}"]  # fmt: skip
    assert (
        main(["fp8-benchmark", "--local", "--work-dir", str(work), *(a for p in params for a in ("--param", p))]) == 0
    )
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    exp = client.get_experiment_by_name("fp8rl-bench")
    (child,) = client.search_runs([exp.experiment_id], "tags.recipe = 'bf16'")
    assert child.info.status == "FINISHED" and child.data.metrics["bench/step_s"] > 0
    # the preset's sampling.ignore_eos: without it this model ends some responses early (a mean of 38.75 tokens)
    assert child.data.metrics["bench/response_tokens"] == 48


def test_recipe_comparison_runs_every_recipe_with_every_seed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``seeds``: one RL step, evaluation and benchmark per recipe and seed, each its own MLflow run under the one
    comparison run, and a row each in the report. ``backend=process``: the RL steps run in their own processes,
    without Ray (the test above covers the local Ray)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    work = tmp_path / "work"
    params = ["recipes=[bf16]", "seeds=[0, 1]", "sft_steps=0", "rl_steps=1", "bench_steps=1", "backend=process",
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
    (log,) = (work / "kfp-local").glob("recipe-comparison-*.log")
    assert "started a local Ray" not in log.read_text() and all(
        "ray.layout" not in c.data.params for c in runs.values()
    )
