"""vLLM inside the Ray rollout workers on GPUs, every weight sync verified bit for bit (``verify_sync``: a
mismatch fails the step), on the small tiny model with eager engines:

- colocated on one GPU, CUDA IPC sync (``ray.sync: ipc``), the engine asleep while the trainer runs;
- split over two GPUs (trainer on one, vLLM on the other), the bucketed NCCL broadcast (``sync: collective``)
  into the engine in place, with the FP8 KV cache recalibrated on Ray after every sync;
- colocated over two GPUs with the trainer sharded (FSDP2, two ranks) and one vLLM worker beside rank 0;
- the same with a vLLM worker beside each rank (both ranks keep the gathered weights for their engine), AdamW's
  moments offloaded to the host between steps (``optim.offload_optimizer_state``) and the engines kept awake from
  the sync to the generation (``ray.sleep_after_sync: false``; this last part added after its 2x H100 run);
- per-channel FP8 rollout weights under block FP8 training (``rollout.fp8_scaling: channel``), colocated on one
  GPU and beside each FSDP2 rank: the trainer requantizes per channel, the engine verifies what vLLM holds
  (transposed for its GEMM) bit for bit;
- one vLLM engine split over the two GPUs (``rollout.tensor_parallel_size: 2``) beside the FSDP2 ranks, with the FP8
  KV cache: both workers run the same requests, each loads the full weights and verifies its half.

The two-GPU cases skip on one GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")
pytest.importorskip("pydantic")
ray = pytest.importorskip("ray")

GPUS = torch.cuda.device_count()
FSDP2 = {"layout": "colocated", "sync": "ipc", "trainer_workers": 2, "trainer_sharding": "fsdp"}
CASES: dict[str, tuple[dict[str, Any], str, int, dict[str, Any]]] = {
    "colocated-ipc": ({"layout": "colocated", "sync": "ipc"}, "fp8-e2e", 1, {}),
    "split-nccl-fp8kv": ({"layout": "split", "sync": "collective"}, "fp8-e2e-kv", 2, {}),
    "fsdp2-colocated-ipc": (FSDP2, "fp8-e2e", 2, {}),
    "fsdp2-two-engines-offload": (
        {**FSDP2, "rollout_workers": 2, "sleep_after_sync": False},
        "fp8-e2e",
        2,
        {"offload_optimizer_state": True},
    ),
    "colocated-ipc-channel": ({"layout": "colocated", "sync": "ipc"}, "fp8-e2e", 1, {}),
    "fsdp2-channel": ({**FSDP2, "rollout_workers": 2, "sleep_after_sync": False}, "fp8-e2e", 2, {}),
    # one engine over both GPUs (rollout.tensor_parallel_size 2, vLLM's external_launcher): each rank verifies its
    # half of every weight; per-channel FP8 (this model's k/v halves are not whole 128-row tiles) and FP8 KV
    "fsdp2-tp2-channel": ({**FSDP2, "rollout_workers": 2, "sleep_after_sync": False}, "fp8-e2e-kv", 2, {}),
}


@pytest.fixture(scope="module")
def local_ray() -> Any:
    ray.init(num_cpus=8, num_gpus=GPUS, object_store_memory=1024 * 1024 * 1024, include_dashboard=False,
             log_to_driver=False)  # fmt: skip
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_on_ray_workers_with_every_sync_verified(
    local_ray: Any, tiny_models: dict[str, Path], tmp_path: Path, case: str
) -> None:
    from fp8rl.cluster.driver import run_rl_on_ray
    from fp8rl.config import RunConfig, load_recipe
    from fp8rl.tracking import MemorySink

    ray_cfg, recipe_name, gpus, optim = CASES[case]
    if gpus > GPUS:
        pytest.skip(f"needs {gpus} GPUs, {GPUS} visible")
    recipe = load_recipe("fp8-e2e")
    if recipe_name == "fp8-e2e-kv":
        recipe = recipe.model_copy(update={"name": "fp8-e2e-kv", "kv_cache": "fp8"})
    cfg = RunConfig.model_validate({
        "recipe": recipe, "steps": 2, "eval_every": 2, "eval_examples": 16, "eval_samples": 0,
        "grpo": {"prompts_per_step": 8, "group_size": 4}, "verify_sync": True, "work_dir": str(tmp_path),
        "rollout": {"engine": "vllm", "gpu_memory_utilization": 0.2, "enforce_eager": True, "max_model_len": 512,
                    "fp8_scaling": "channel" if case.endswith("-channel") else "recipe",
                    "tensor_parallel_size": 2 if "-tp2" in case else 1},
        "ray": ray_cfg, "optim": optim,
    })  # fmt: skip
    lines: list[str] = []
    res = run_rl_on_ray(cfg, tiny_models["small"], MemorySink(), log=lines.append)
    layout = next(line for line in lines if line.startswith("ray:"))
    assert f"layout {ray_cfg['layout']}" in layout and f"sync {ray_cfg['sync']}" in layout
    assert f"trainer sharding {ray_cfg.get('trainer_sharding', 'replicate')}" in layout
    assert f"{ray_cfg.get('rollout_workers', 1)} rollout worker(s)" in layout
    assert ("rollout tensor parallel 2" in layout) == ("-tp2" in case)
    assert [h["sync/policy_version"] for h in res.history] == [1.0, 2.0]
    for h in res.history:
        assert 0 < h["sync/bytes_vs_bf16"] < 1  # FP8 linears on the wire
        assert h["time/sync_s"] > 0 and h["reward"] == h["reward"]
        if recipe.kv_cache == "fp8":  # recalibrated from the trainer's activations after every sync, on Ray
            assert h["time/kv_calibrate_s"] > 0 and any(k.startswith("kv/") for k in h)
        if ray_cfg["layout"] == "colocated":  # the engine sleeps while the trainer runs: memory handed back
            assert h["memory/rollout_sleep_freed_gb"] > 0
