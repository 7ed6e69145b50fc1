"""The throughput benchmark of a Ray recipe starts its own local Ray when none runs, and stops it after; its
``profile_train`` step reaches the trainer worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from fp8rl.bench.throughput import benchmark_recipe
from fp8rl.config import RayConfig, RunConfig, load_recipe

ray = pytest.importorskip("ray")


def test_bench_on_ray_starts_and_stops_a_local_ray(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    if ray.is_initialized():
        ray.shutdown()  # another module's Ray: this test is about the benchmark starting its own
    cfg = RunConfig.model_validate(
        {
            "recipe": load_recipe("fp8-e2e"),
            "grpo": {"prompts_per_step": 2, "group_size": 2},
            "work_dir": str(tmp_path),
            "ray": RayConfig(trainer_workers=1, rollout_workers=1, object_store_mb=128),
        }
    )
    lines: list[str] = []
    result = benchmark_recipe(
        cfg, tiny_models["tiny"], "cpu", steps=1, warmup_steps=0, log=lines.append, profile_train=True
    )
    assert result.rollout_tokens_per_s > 0 and result.train_tokens_per_s > 0 and result.sync_bytes > 0
    assert any("timed" in line for line in lines)
    # the start-up's time, in the form an isolated recipe's process passes on
    assert any(line.startswith("[fp8-e2e] bench step 0 (start): Ray, the trainers") for line in lines)
    # --profile-train through the Ray trainer group: the worker's policy step under the profiler
    assert result.train_device_ms is not None and result.train_device_ms["gemm"] > 0
    assert any("(profiled, not timed)" in line for line in lines)
    # CPU actors have no GPU to sample: no peak is made up
    assert result.peak_gpu_used_gb is None and result.peak_gpu_used_gb_per_gpu is None
    assert result.peak_allocated_gb is None
    assert not ray.is_initialized()  # the benchmark's own Ray is shut down with it
