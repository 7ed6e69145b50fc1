"""``optim.offload_optimizer_state`` on a GPU: AdamW's moments go to pinned host buffers after each step and
their device memory is released (the caching allocator gives it back), fused AdamW takes the same steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("pydantic")  # the trainer reads fp8rl.config (the bare GPU image has no pydantic)


def test_offloaded_moments_on_cuda_give_the_same_steps_and_free_the_device(tiny_models: dict[str, Path]) -> None:
    from fp8rl.config import GRPOConfig, OptimConfig
    from fp8rl.train.trainer import TorchTrainer, TrainerOptions

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from sharded_trainer_worker import fixed_batch

    batch, adv, old, mask = fixed_batch()

    def run(offload: bool) -> tuple[TorchTrainer, list[dict[str, float]], int]:
        t = TorchTrainer(tiny_models["small"], TrainerOptions(optim=OptimConfig(lr=1e-3, micro_batch_size=4, offload_optimizer_state=offload, warmup_steps=0)), device="cuda")  # fmt: skip
        history = [
            t.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0)) for _ in range(2)
        ]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return t, history, torch.cuda.memory_allocated()

    plain, h_plain, _ = run(False)
    moment_bytes = sum(v.numel() * v.element_size() for s in plain.optimizer.optimizer.state.values()
                       for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))  # fmt: skip
    before = torch.cuda.memory_allocated()
    off, h_off, after = run(True)
    numbers = [{k: v for k, v in m.items() if k not in ("optimizer_offload_s", "cuda_alloc_retries")} for m in h_off]
    assert numbers == [{k: v for k, v in m.items() if k != "cuda_alloc_retries"} for m in h_plain]
    assert all(m["optimizer_offload_s"] > 0 for m in h_off)  # each step copied the moments back and out
    for name, w in plain.hf_state_dict().items():
        assert torch.equal(w, off.hf_state_dict()[name]), name
    state = off.optimizer.optimizer.state
    moments = [v for s in state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(v.is_cuda and v.untyped_storage().nbytes() == 0 for v in moments)
    offload = off.optimizer.offload
    assert offload is not None and all(h.is_pinned() for h in offload._host.values())
    # the second trainer holds its weights, masters and gradient accumulators on the device, not its moments
    held = after - before
    print(f"moments {moment_bytes / 2**20:.1f} MiB; the offloading trainer holds {held / 2**20:.1f} MiB on the GPU")
    # (before: all this process holds with the plain trainer alive, its moments included)
    assert held <= before - moment_bytes + 2**20
