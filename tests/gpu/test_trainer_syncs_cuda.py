"""The trainer's step does not wait for the GPU once per micro-batch.

A host read of a device value (``float(t)``, ``.tolist()``, ``.cpu()``) or a copy from pageable host memory
(``.to("cuda")``) synchronises with the stream: the host waits for everything queued, and the GPU then idles while
the host prepares and launches the next micro-batch (the 8B FP8 train step's compute stream idles ~1.6 s; whether such
drains are the cause is measured in docs/benchmarks.md).  Counted with PyTorch's sync debug mode (one warning per synchronising call): the number of
synchronisations of a step and of a logprob pass must not grow with the number of micro-batches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
pytest.importorskip("pydantic")  # the trainer reads fp8rl.config (the bare GPU image has no pydantic)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "integration"))


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_syncs_per_step_do_not_grow_with_micro_batches(tiny_models: dict[str, Path], precision: str) -> None:
    from cuda_syncs import record_syncs
    from sharded_trainer_worker import fixed_batch

    from fp8rl.config import GRPOConfig, OptimConfig
    from fp8rl.train.trainer import TorchTrainer, TrainerOptions

    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89+")
    batch, adv, old, mask = fixed_batch()
    counts = {}
    for micro in (10, 2, 1):  # one micro-batch of the 10 rows (padded), five, ten (one row each: nothing padded)
        trainer = TorchTrainer(
            tiny_models["small"],
            TrainerOptions(precision=precision, optim=OptimConfig(micro_batch_size=micro, lr=2e-5, warmup_steps=0)),
            "cuda",
        )
        trainer.policy_step(
            PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0)
        )  # warm-up: lazy inits may sync
        trainer.compute_logprobs(batch, 1.0)
        step = record_syncs(
            lambda t=trainer: t.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0))
        )
        logprobs = record_syncs(lambda t=trainer: t.compute_logprobs(batch, 1.0))
        counts[micro] = (step, logprobs)
    print({m: {"step": Counter(s), "logprobs": Counter(lp)} for m, (s, lp) in counts.items()})
    assert [len(w) for w in counts[2]] == [len(w) for w in counts[1]] == [len(w) for w in counts[10]], (
        f"synchronisations by micro-batch size: {counts}"
    )
    assert counts[10][0]  # the mode counts: the step reads its grad norm and metrics back at least once


def test_sharded_fp8_step_syncs_do_not_grow_with_micro_batches(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The same under the 8B benchmark's trainer: FSDP2 over the GPUs (NCCL, at most two), FP8 with each layer
    gathered once per step, activation checkpointing and the compiled elementwise parts. Rank 0 runs its 8 rows as
    two micro-batches and as eight, rank 1 its 2 rows padded to as many; the second step is compared (the first
    compiles and initialises)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89+")
    world = min(torch.cuda.device_count(), 2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    counts = {}
    for micro in (4, 1):
        out = tmp_path / f"micro{micro}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               str(ROOT / "tests/integration/sharded_trainer_worker.py"), str(tiny_models["small"]), str(out),
               "--device", "cuda", "--precision", "fp8", "--activation-checkpointing", "--compile-elementwise",
               "--micro-batch-size", str(micro), "--count-syncs"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        counts[micro] = torch.load(out / "result.pt", weights_only=False)["syncs"]  # [rank][step 1, 2, logprobs]
    for rank in range(world):
        print(f"rank {rank}:", {m: [dict(Counter(s)) for s in c[rank]] for m, c in counts.items()})
    for rank in range(world):
        step2 = {m: len(c[rank][1]) for m, c in counts.items()}
        logprobs = {m: len(c[rank][2]) for m, c in counts.items()}
        assert step2[4] == step2[1] and logprobs[4] == logprobs[1], (
            f"rank {rank}: synchronisations of step 2 by micro-batch size {step2}, of the logprob pass {logprobs}: "
            f"{ {m: c[rank][1:] for m, c in counts.items()} }"
        )
