"""The one-process RL loop end to end on the tiny model, for every recipe, tracked in a real MLflow store."""

from __future__ import annotations

import subprocess
import sys
import time
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


def test_per_channel_rollout_under_block_training_syncs_bit_exactly(warm_model: Path) -> None:
    """``rollout.fp8_scaling: channel`` with fp8-e2e: the trainer keeps 128x128 block FP8, every sync requantizes
    per channel for the engine (verified bit for bit, as every sync is by default), so generation and training
    no longer share their quantization: a real mismatch where the block rollout above has none."""
    cfg = RunConfig.model_validate(
        {"recipe": load_recipe("fp8-e2e"), "steps": 2, "eval_every": 2, "eval_examples": 16,
         "rollout": {"fp8_scaling": "channel"}}
    )  # fmt: skip
    assert cfg.verify_sync
    result = run_rl(cfg, warm_model, MemorySink(), log=lambda _s: None)
    assert [h["sync/policy_version"] for h in result.history] == [1.0, 2.0]
    assert result.run_mean("mismatch/token_mult_prob_error") > 1.0001
    assert result.history[-1]["sync/bytes_vs_bf16"] < 0.75


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
    # the device, on the run's first line and as a tag; the FP8 linears, printed and as params (tiny: 2 x 7)
    assert r.stdout.splitlines()[0] == "[fp8-e2e-seed0] device: cpu"
    assert "[fp8-e2e] FP8 linears: 14 in the rollout engine, 14 in the trainer" in r.stdout
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("fp8rl").experiment_id])
    assert len(runs) == 1 and runs[0].data.tags["recipe"] == "fp8-e2e" and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["recipe"] == "fp8-e2e" and runs[0].data.tags["fp8rl.device"] == "cpu"
    assert runs[0].data.params["fp8_linears_engine"] == runs[0].data.params["fp8_linears_trainer"] == "14"
    # where the number came from: versions, the commit, the GPUs (none here)
    import torch

    import fp8rl

    tags = runs[0].data.tags
    assert tags["fp8rl.version"] == fp8rl.__version__
    # the installed distribution's version, with or without the local "+cu..." tag, as its metadata says
    assert tags["version.torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert tags["gpu.count"] == "0" and tags["gpu.model"] == "none" and tags["version.vllm"] in ("absent", "0.26.0")
    assert len(tags["fp8rl.git_sha"]) == 12 or tags["fp8rl.git_sha"] == "unknown"
    assert len(client.get_metric_history(runs[0].info.run_id, "mismatch/token_mult_prob_error")) == 2
    r = subprocess.run([sys.executable, "-m", "fp8rl", "train", "--recipe", "fp9"], capture_output=True, text=True)
    assert r.returncode == 2 and "not a built-in recipe" in r.stderr


def test_compare_recipes_logs_children_plots_and_config(tmp_path: Path, warm_model: Path) -> None:
    from mlflow.tracking import MlflowClient

    from fp8rl.experiment import compare_recipes

    cfgs = [
        RunConfig(recipe=load_recipe(name), steps=2, eval_every=2, eval_examples=16, work_dir=str(tmp_path), seed=seed)
        for name in ("bf16", "fp8-rollout")
        for seed in (0, 1)
    ]
    comparison = compare_recipes(cfgs, warm_model, log=lambda _s: None)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    parent = client.get_run(comparison.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.params["recipes"] == "bf16,bf16,fp8-rollout,fp8-rollout"
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{comparison.parent_run_id}'"
    )
    assert sorted(c.info.run_name for c in children) == [
        "bf16-seed0",
        "bf16-seed1",
        "fp8-rollout-seed0",
        "fp8-rollout-seed1",
    ]
    for child in children:
        assert child.info.status == "FINISHED"
        assert child.data.tags["recipe"] == child.data.params["recipe"] == child.info.run_name.rsplit("-seed", 1)[0]
        assert (
            child.data.params["grpo.group_size"] == "8"
            and child.data.params["recipe_config.quant.granularity"] == "block"
        )
        names = {a.path for a in client.list_artifacts(child.info.run_id, "plots")}
        assert names == {
            "plots/reward.png",
            "plots/heldout_accuracy.png",
            "plots/heldout_sampled_accuracy.png",
            "plots/token_mult_prob_error.png",
        }
        resolved = Path(client.download_artifacts(child.info.run_id, "config/resolved.yaml", str(tmp_path / "dl")))
        import yaml

        data = yaml.safe_load(resolved.read_text())
        assert data["recipe"]["name"] == child.data.params["recipe"] and data["steps"] == 2
        assert RunConfig.model_validate(data).seed == int(child.data.tags["seed"])  # the artifact round-trips
    parent_plots = {a.path for a in client.list_artifacts(comparison.parent_run_id, "plots")}
    assert "plots/token_mult_prob_error.png" in parent_plots
    table = Path(client.download_artifacts(comparison.parent_run_id, "comparison.md", str(tmp_path / "dl2")))
    rows = [line for line in table.read_text().splitlines() if line.startswith("| fp8-rollout")]
    assert len(rows) == 2 and comparison.table == table.read_text()
    # the mean token_mult_prob_error column is filled from the loop's own metric key
    assert all(float(r.strip("|").split("|")[-1]) > 1.0 for r in rows)


def test_cli_train_config_file_and_several_recipes(tmp_path: Path, warm_model: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {warm_model}\nsteps: 1\neval_every: 1\neval_examples: 8\ngrpo:\n  prompts_per_step: 4\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "fp8rl", "train", "--config", str(config), "--work-dir", str(tmp_path)]
    r = subprocess.run([*cmd, "--recipe", "bf16", "--recipe", "fp8-e2e"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| bf16 | bf16-seed0 | FINISHED |" in r.stdout and "fp8-e2e seed 0: held-out accuracy" in r.stdout

    config.write_text("grpo:\n  prompts_per_step: 0\n")
    r = subprocess.run([*cmd, "--model", str(warm_model)], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "grpo.prompts_per_step" in r.stderr and str(config) in r.stderr
    r = subprocess.run([*cmd[:4], "--seeds", "0,x"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "--seeds" in r.stderr


def test_a_killed_driver_resumes_into_the_same_mlflow_run(tmp_path: Path, warm_model: Path) -> None:
    """Kill `fp8rl train` after step 2 (checkpointed every step), run it again: steps 3-4 follow in the same run."""
    import signal

    from mlflow.tracking import MlflowClient

    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "fp8rl", "train", "--recipe", "fp8-rollout", "--model", str(warm_model)]
    cmd += ["--steps", "4", "--work-dir", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ckpt")]
    cmd += ["--checkpoint-every", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "step 2/4" in line:
            # the step-2 checkpoint is written right after this line; wait for it, then kill
            deadline = time.monotonic() + 60
            while not (tmp_path / "ckpt" / "step-000002").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from the checkpoint of step" in r.stdout
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("fp8rl").experiment_id])
    assert len(runs) == 1  # the rerun logged into the first attempt's run
    steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "reward"))
    assert steps == [1, 2, 3, 4]  # none lost, none repeated
    assert runs[0].info.status == "FINISHED"


def test_loop_with_users_data_chat_messages_and_a_python_reward(tmp_path: Path, warm_model: Path) -> None:
    """A JSONL task (GSM8K-style answers, extra fields) and a user's Python reward, through the loop."""
    import json

    rows = [
        {"prompt": f"{a}+{b}=", "answer": f"#### {a + b}", "level": a % 3} for a in range(1, 10) for b in range(1, 9)
    ]
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows[8:]))
    test.write_text("\n".join(json.dumps(r) for r in rows[1:8]))
    calls = tmp_path / "calls.txt"
    reward = tmp_path / "reward.py"
    reward.write_text(
        "from fp8rl.tasks.rewards import extract_last_number\n"
        f"def score(response, answer, example):\n"
        f"    with open({str(calls)!r}, 'a') as f:\n"
        f"        f.write(str(example.get('level', '-')) + '\\n')\n"
        f"    return 1.0 if extract_last_number(response) == answer else 0.0\n"
    )
    cfg = RunConfig.model_validate(
        {
            "recipe": load_recipe("fp8-e2e").model_dump(),
            "steps": 2,
            "eval_every": 2,
            "eval_examples": 7,
            "eval_samples": 0,
            "task": {"type": "jsonl", "train": str(train), "test": str(test), "chat_template": "auto"},
            "reward": {"type": "python", "function": f"{reward}:score"},
        }
    )
    result = run_rl(cfg, warm_model, MemorySink(), log=lambda _s: None)
    last = result.history[-1]
    assert last["reward/errors"] == 0.0 and last["reward/timeouts"] == 0.0
    assert 0.0 <= last["reward"] <= 1.0 and "eval/accuracy" in last
    seen = calls.read_text().split()
    # every rollout and every held-out response was scored by the user's function, with the record's extra fields
    n_rollouts = 2 * cfg.grpo.prompts_per_step * cfg.grpo.group_size
    assert len(seen) >= n_rollouts + 7 and set(seen) <= {"0", "1", "2", "-"}


def test_cli_train_checks_task_files_before_model_work(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 3, "answer": "4"}\n')
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"task: {{type: jsonl, train: {bad}, test: {bad}}}\nwork_dir: {tmp_path / 'work'}\n")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "fp8rl", "train", "--config", str(cfg), "--recipe", "bf16"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"{bad}:2: 'prompt' must be a string" in proc.stderr
    assert time.monotonic() - t0 < 60 and not (tmp_path / "work" / "models").exists()  # no SFT warm-up ran
