"""scripts/bench_peer_trl.py's table: fp8rl's rows and TRL's in one document, the speedups against both baselines,
TRL's settings taken from the preset, and the phase timer TRL's trainer drives.  (TRL itself runs on a GPU only: not
here.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_peer_trl as peer


def _fp8rl_doc() -> dict:
    rows = [
        {"recipe": "bf16", "step_s": 60.0, "generate_s": 24.0, "train_s": 34.0, "sync_s": 1.0, "logprob_s": 0.0,
         "rollout_tokens_per_s": 21_000.0, "train_tokens_per_s": 15_000.0, "peak_gpu_used_gb": 130.0},
        {"recipe": "fp8-e2e-kv", "step_s": 45.0, "generate_s": 16.0, "train_s": 27.0, "sync_s": 1.5, "logprob_s": 0.0,
         "rollout_tokens_per_s": 32_000.0, "train_tokens_per_s": 19_000.0, "peak_gpu_used_gb": 128.0},
    ]  # fmt: skip
    return {"meta": {"model": "llama-8b"}, "results": rows}


def test_trl_row_takes_medians_of_the_timed_steps_after_the_warmup() -> None:
    settings = {"warmup": 1, "steps": 3, "prompts": 2, "samples": 4, "max_tokens": 100}
    phases = {"step": [90.0, 10.0, 12.0, 11.0], "generate": [50.0, 4.0, 5.0, 4.5], "sync": [9.0, 1.0, 1.0, 1.0]}
    row = peer.trl_row(phases, settings, 77.0, "1.16.0")
    assert row["peer"] == "trl" and row["recipe"] == "bf16" and row["step_times"] == [10.0, 12.0, 11.0]
    assert (row["step_s"], row["generate_s"], row["sync_s"]) == (11.0, 4.5, 1.0)
    assert row["train_s"] == pytest.approx(5.5)  # the median of 10-4-1, 12-5-1, 11-4.5-1
    assert row["rollout_tokens_per_s"] == pytest.approx(800 / 4.5) and row["peak_gpu_used_gb"] == 77.0
    with pytest.raises(RuntimeError, match="3 sync phases for 4 steps"):
        peer.trl_row({**phases, "sync": [1.0, 1.0, 1.0]}, settings, None, "1.16.0")


def test_the_merged_table_compares_every_row_with_fp8rls_bf16_and_trls() -> None:
    trl = {"peer": "trl", "peer_version": "1.16.0", "recipe": "bf16", "step_s": 72.0, "generate_s": 30.0,
           "train_s": 40.0, "sync_s": 2.0, "logprob_s": 0.0, "rollout_tokens_per_s": 17_000.0,
           "train_tokens_per_s": 13_000.0, "peak_gpu_used_gb": None}  # fmt: skip
    doc = peer.merged(_fp8rl_doc(), trl)
    fp8 = next(r for r in doc["results"] if r["recipe"] == "fp8-e2e-kv")
    assert fp8["peer"] is None and fp8["speedup"]["trl"]["step"] == pytest.approx(72 / 45)
    assert fp8["speedup"]["fp8rl bf16"]["generate"] == pytest.approx(24 / 16)
    assert doc["results"][-1]["speedup"]["fp8rl bf16"]["step"] == pytest.approx(60 / 72)
    table = peer.markdown(doc)
    assert "| fp8rl fp8-e2e-kv | 45.00 | 1.33x | 1.60x |" in table
    assert "| TRL 1.16.0 GRPOTrainer, bf16 | 72.00 | 0.83x | 1.00x |" in table and table.rstrip().endswith("| - |")
    assert "vs TRL bf16" not in peer.markdown(peer.merged(_fp8rl_doc(), None)).split("\n")[2]  # no TRL: no ratio


def test_trl_gets_the_presets_batch_and_engine_settings() -> None:
    settings = peer.preset_settings("llama-8b-h200")
    args = peer.grpo_arguments(settings, Path("out"))
    assert settings["shape"] == "llama-8b" and settings["activation_checkpointing"] is True
    rows = args["per_device_train_batch_size"] * args["gradient_accumulation_steps"]
    assert rows == settings["prompts"] * settings["samples"] == 512 and args["num_generations"] == 8
    assert args["max_steps"] == settings["warmup"] + settings["steps"] and args["generation_kwargs"]["ignore_eos"]
    assert args["vllm_gpu_memory_utilization"] == settings["gpu_memory_utilization"] == 0.55
    assert args["vllm_importance_sampling_correction"] is False and args["beta"] == 0.0  # as fp8rl's bf16
    prompts = peer.task_prompts(settings, 3)
    assert len(prompts) == 3 and all(p.endswith("=") for p in prompts)  # the arithmetic task's raw prompts


def test_the_phase_timer_closes_one_entry_a_step_and_resets_the_peak_after_the_warmup() -> None:
    """The timer as TRL's trainer drives it: its callback (a real ``transformers.TrainerCallback``) around each
    optimizer step, the wrapped generate and sync calls inside; the row it feeds takes the timed steps."""
    import time
    from types import SimpleNamespace

    from transformers import TrainerCallback

    resets: list[bool] = []
    sampler = SimpleNamespace(peak=lambda reset=False: resets.append(reset) or 0)
    timer = peer.PhaseTimer(total=3, warmup=1, sampler=sampler)
    callback = timer.callback()
    assert isinstance(callback, TrainerCallback)
    generate = timer.wrap(lambda n: time.sleep(0.02) or n, "generate")
    sync = timer.wrap(lambda: time.sleep(0.01), "sync")
    for step in (1, 2, 3):
        callback.on_step_begin(None, SimpleNamespace(global_step=step - 1), None)
        sync()
        assert generate(step) == step  # the wrapped call's value comes back
        time.sleep(0.01)  # the rest of the step: train
        callback.on_step_end(None, SimpleNamespace(global_step=step), None)
    assert {k: len(v) for k, v in timer.phases.items()} == {"generate": 3, "sync": 3, "step": 3}
    gen, syn, step = timer.phases["generate"], timer.phases["sync"], timer.phases["step"]
    assert all(g >= 0.02 and y >= 0.01 for g, y in zip(gen, syn, strict=True))
    assert all(s > g + y for s, g, y in zip(step, gen, syn, strict=True))
    assert resets == [True]  # once, at the end of the warm-up step
    settings = {"warmup": 1, "steps": 2, "prompts": 2, "samples": 2, "max_tokens": 4}
    row = peer.trl_row(timer.phases, settings, None, "1.16.0")
    assert row["step_times"] == timer.phases["step"][1:] and row["train_s"] > 0
