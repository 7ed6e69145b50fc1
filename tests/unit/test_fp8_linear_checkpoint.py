"""Activation checkpointing and the FP8 linears (``fp8rl.train.fp8_linear.checkpoint_contexts``).

Non-reentrant checkpointing keeps only the metadata of what a layer's first forward saves, so there the fused
FP8 linear skips the transposed copy of its input and saves stand-ins.  On the CPU the reference path runs (it
ignores the flag); these tests check the plumbing: the trainer hands the contexts to HF's checkpointing, the flag
is set in exactly the first forwards, and the stand-ins have the shapes the recompute's real copies have.
``tests/gpu/test_quant_kernels.py`` checks on a GPU that the fused path's outputs and gradients are bit-identical
with and without the skip, and that the first forward made no transposed copy.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fp8rl.quant import QuantSpec
from fp8rl.quant.block_linear import padded_rows
from fp8rl.train import fp8_linear
from fp8rl.train.fp8_linear import FP8TrainLinear, _placeholders, checkpoint_contexts
from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld


def test_the_flag_is_set_in_the_first_forward_only_and_restored() -> None:
    first, recompute = checkpoint_contexts()
    assert not fp8_linear._checkpoint_state.discarded
    with first:
        assert fp8_linear._checkpoint_state.discarded
        with checkpoint_contexts()[0]:  # nested regions restore the outer state
            assert fp8_linear._checkpoint_state.discarded
        assert fp8_linear._checkpoint_state.discarded
    with recompute:
        assert not fp8_linear._checkpoint_state.discarded
    assert not fp8_linear._checkpoint_state.discarded
    with checkpoint_contexts()[0], checkpoint_contexts()[1]:  # a recompute inside a first forward saves real copies
        assert not fp8_linear._checkpoint_state.discarded


@pytest.mark.parametrize("m", [1, 127, 128, 300, 16384])
def test_placeholders_have_the_transposed_copys_shapes_and_no_memory(m: int) -> None:
    qt, st = _placeholders(256, m, QuantSpec(), torch.device("cpu"))
    mp = padded_rows(m, 128)
    assert (tuple(qt.shape), qt.dtype) == ((256, mp), torch.float8_e4m3fn)
    assert (tuple(st.shape), st.dtype) == ((256, math.ceil(mp / 128)), torch.float32)
    assert qt.stride() == (0, 0) and st.stride() == (0, 0)  # views of one element


def test_the_trainer_checkpoints_with_the_contexts_and_flags_only_the_first_forwards(
    tiny_models: dict[str, Path],
) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from sharded_trainer_worker import fixed_batch

    from fp8rl.config import GRPOConfig, OptimConfig
    from fp8rl.train.trainer import TorchTrainer, TrainerOptions

    batch, adv, old, mask = fixed_batch()
    results = []
    for checkpointing in (False, True):
        opts = TrainerOptions(
            precision="fp8",
            optim=OptimConfig(lr=1e-3, micro_batch_size=10, activation_checkpointing=checkpointing, warmup_steps=0),
        )
        trainer = TorchTrainer(tiny_models["small"], opts, device="cpu")
        linears = [m for m in trainer.model.modules() if isinstance(m, FP8TrainLinear)]
        seen: list[bool] = []
        hook = linears[0].register_forward_pre_hook(
            lambda *_, seen=seen: seen.append(fp8_linear._checkpoint_state.discarded)
        )
        results.append(trainer.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0)))
        hook.remove()
        # one micro-batch: without checkpointing one forward; with it, the first forward (flagged) and the recompute
        assert seen == ([True, False] if checkpointing else [False])
    assert results[1]["loss"] == pytest.approx(results[0]["loss"], rel=1e-6)
    assert results[1]["grad_norm"] == pytest.approx(results[0]["grad_norm"], rel=1e-5)
