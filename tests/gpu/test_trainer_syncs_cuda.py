"""The trainer's step does not wait for the GPU once per micro-batch.

A host read of a device value (``float(t)``, ``.tolist()``, ``.cpu()``) or a copy from pageable host memory
(``.to("cuda")``) synchronises with the stream: the host waits for everything queued, and the GPU then idles while
the host prepares and launches the next micro-batch (the 8B FP8 train step's compute stream idles ~1.6 s; whether such
drains are the cause is measured in docs/benchmarks.md).  Counted with PyTorch's sync debug mode (one warning per synchronising call): the number of
synchronisations of a step and of a logprob pass must not grow with the number of micro-batches.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
pytest.importorskip("pydantic")  # the trainer reads fp8rl.config (the bare GPU image has no pydantic)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))


TORCH, WARNINGS = str(Path(torch.__file__).parent), warnings.__file__


def _syncs(fn) -> list[str]:
    """Where each synchronisation ``fn`` makes was called from: its innermost frames outside torch (file:line)."""
    torch.cuda.synchronize()
    where: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if "synchronizing" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith((TORCH, WARNINGS))]
            where.append(" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-5:])))

    with warnings.catch_warnings():  # restores showwarning and the filters
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return where


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_syncs_per_step_do_not_grow_with_micro_batches(tiny_models: dict[str, Path], precision: str) -> None:
    from sharded_trainer_worker import fixed_batch

    from fp8rl.config import GRPOConfig
    from fp8rl.train.trainer import TorchTrainer, TrainerOptions

    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89+")
    batch, adv, old, mask = fixed_batch()
    counts = {}
    for micro in (10, 2, 1):  # one micro-batch of the 10 rows (padded), five, ten (one row each: nothing padded)
        trainer = TorchTrainer(
            tiny_models["small"], TrainerOptions(precision=precision, micro_batch_size=micro), "cuda"
        )
        trainer.policy_step(batch, adv, old, None, mask, GRPOConfig(), 1.0)  # warm-up: lazy inits may sync
        trainer.compute_logprobs(batch, 1.0)
        step = _syncs(lambda t=trainer: t.policy_step(batch, adv, old, None, mask, GRPOConfig(), 1.0))
        logprobs = _syncs(lambda t=trainer: t.compute_logprobs(batch, 1.0))
        counts[micro] = (step, logprobs)
    print({m: {"step": Counter(s), "logprobs": Counter(lp)} for m, (s, lp) in counts.items()})
    assert [len(w) for w in counts[2]] == [len(w) for w in counts[1]] == [len(w) for w in counts[10]], (
        f"synchronisations by micro-batch size: {counts}"
    )
    assert counts[10][0]  # the mode counts: the step reads its grad norm and metrics back at least once
