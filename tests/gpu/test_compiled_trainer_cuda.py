"""``optim.compile_elementwise`` on a GPU: the trainer with Inductor/Triton RMSNorm, SiLU gate and rotary kernels.

The same policy steps as the eager trainer (tiny model with whole 128-tiles, so FP8 takes the fused Hopper
path), losses and gradient norms within rounding; the CPU test (``tests/unit/test_compiled_elementwise.py``)
checks the patched modules and the numerics on Inductor's CPU backend.  With activation checkpointing too:
the combination failed on CUDA before the compiled parts became autograd.Functions (the recompute saved other
tensors than the forward, docs/benchmarks.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
pytest.importorskip("pydantic")  # the trainer reads fp8rl.config (the bare GPU image has no pydantic)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["stored", "recomputed"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_compiled_trainer_matches_the_eager_one_on_cuda(
    tiny_models: dict[str, Path], precision: str, checkpointing: bool
) -> None:
    from sharded_trainer_worker import fixed_batch

    from fp8rl.config import GRPOConfig, OptimConfig
    from fp8rl.train.trainer import TorchTrainer, TrainerOptions

    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89+")
    batch, adv, old, mask = fixed_batch()
    runs = []
    for compiled in (False, True):
        opts = TrainerOptions(precision=precision, optim=OptimConfig(lr=1e-3, micro_batch_size=4, compile_elementwise=compiled, activation_checkpointing=checkpointing, warmup_steps=0))  # fmt: skip
        trainer = TorchTrainer(tiny_models["small"], opts, device="cuda")
        assert bool(trainer.compiled_modules) == compiled
        runs.append(
            [
                trainer.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0))
                for _ in range(3)
            ]
        )
    for eager, fused in zip(*runs, strict=True):
        assert fused["loss"] == pytest.approx(eager["loss"], rel=2e-2, abs=1e-4)
        assert fused["grad_norm"] == pytest.approx(eager["grad_norm"], rel=5e-2)
