"""The one-process RL loop end to end on the tiny model, for every recipe, tracked in a real MLflow store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fp8rl.config import RunConfig, load_recipe
from fp8rl.loop import run_rl
from fp8rl.tracking import MemorySink
from fp8rl.train.sft import SFTOptions, sft_warmup


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sft") / "model"
    sft_warmup(path, SFTOptions(steps=60, batch_size=64, lr=5e-3), log_every=60)
    return path


@pytest.mark.parametrize("recipe", ["bf16", "fp8-rollout", "fp8-e2e"])
def test_loop_runs_and_logs_every_metric(warm_model: Path, recipe: str) -> None:
    cfg = RunConfig(recipe=load_recipe(recipe), steps=2, eval_every=2, eval_examples=32)
    sink = MemorySink()
    result = run_rl(cfg, warm_model, sink, log=lambda _s: None)
    assert len(result.history) == 2
    for key in [
        "reward",
        "accuracy",
        "response_length",
        "train/loss",
        "train/grad_norm",
        "mismatch/token_mult_prob_error",
        "mismatch/gen_kl",
        "mismatch/policy_kl",
        "mismatch/js_divergence",
        "mismatch/rollout_probs_diff_max",
        "correction/is_weight_mean",
        "correction/is_ess",
        "time/generate_s",
        "time/logprob_s",
        "time/train_s",
        "time/sync_s",
        "throughput/rollout_tokens_per_s",
        "sync/bytes",
        "eval/accuracy",
    ]:
        assert key in result.history[-1], key
    assert [h["sync/policy_version"] for h in result.history] == [1.0, 2.0]
    tmpe = result.run_mean("mismatch/token_mult_prob_error")
    assert tmpe >= 1.0
    if recipe == "fp8-rollout":
        # FP8 generation vs BF16 training: a real mismatch, and FP8 sync moves ~half the bytes
        assert tmpe > 1.001
        assert result.history[-1]["sync/bytes_vs_bf16"] < 0.75
    else:
        # on CPU the engine and the trainer run bit-identical numerics (same quantization, same kernels)
        assert tmpe == pytest.approx(1.0, abs=1e-4)


def test_cli_train_tracks_in_mlflow(tmp_path: Path, warm_model: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fp8rl",
            "train",
            "--recipe",
            "fp8-e2e",
            "--model",
            str(warm_model),
            "--steps",
            "2",
            "--work-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "[fp8-e2e] step 2/2" in r.stdout and "mlflow ui --backend-store-uri sqlite:///" in r.stdout
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("fp8rl").experiment_id])
    assert len(runs) == 1 and runs[0].data.tags["recipe"] == "fp8-e2e" and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["recipe"] == "fp8-e2e"
    assert len(client.get_metric_history(runs[0].info.run_id, "mismatch/token_mult_prob_error")) == 2
    r = subprocess.run([sys.executable, "-m", "fp8rl", "train", "--recipe", "fp9"], capture_output=True, text=True)
    assert r.returncode == 2 and "not a built-in recipe" in r.stderr
