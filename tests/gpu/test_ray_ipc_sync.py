"""``ray.sync: ipc`` on a GPU: the trainer actor and the rollout actor share the GPU (colocated layout), and
each push goes through CUDA IPC instead of the Ray object store.  The run must be the object-store run, step
for step (same samples, losses, bytes and held-out result), with every push verified bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
pytest.importorskip("pydantic")
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray() -> object:
    ray.init(num_cpus=4, num_gpus=1, object_store_memory=512 * 1024 * 1024, include_dashboard=False,
             log_to_driver=False)  # fmt: skip
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("recipe", ["bf16", "fp8-e2e"])
def test_ipc_sync_matches_the_object_store_run(local_ray: object, tiny_models: dict[str, Path], tmp_path: Path,
                                               recipe: str) -> None:  # fmt: skip
    from fp8rl.cluster.driver import run_rl_on_ray
    from fp8rl.config import RayConfig, RunConfig, load_recipe
    from fp8rl.tracking import MemorySink

    def cfg(sync: str) -> RunConfig:
        return RunConfig.model_validate({
            "recipe": load_recipe(recipe), "steps": 2, "eval_every": 2, "eval_examples": 16, "eval_samples": 0,
            "grpo": {"prompts_per_step": 8, "group_size": 4}, "verify_sync": True, "work_dir": str(tmp_path),
            "ray": RayConfig(layout="colocated", sync=sync),  # type: ignore[arg-type]
        })  # fmt: skip

    lines: list[str] = []
    store = run_rl_on_ray(cfg("objectstore"), tiny_models["small"], MemorySink(), log=lines.append)
    ipc = run_rl_on_ray(cfg("ipc"), tiny_models["small"], MemorySink(), log=lines.append)
    assert any("sync ipc" in line for line in lines)
    for a, b in zip(store.history, ipc.history, strict=True):
        assert b["reward"] == a["reward"] and b["train/loss"] == a["train/loss"]
        assert b["sync/bytes"] == a["sync/bytes"] and b["sync/policy_version"] == a["sync/policy_version"]
        assert b["time/sync_requantize_s"] > 0 and b["time/sync_load_s"] > 0
    assert ipc.final == store.final
