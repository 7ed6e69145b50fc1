"""``optim.fp8_gather_once`` in one process: which FSDP2 units it applies to and what the FP8 linears cache; and what
the sharded trainer tells FSDP2 before each micro-batch's backward.

A one-rank gloo group runs real FSDP2 here (no communication); the two-rank runs that compare the numbers with and
without it are ``tests/integration/test_sharded_trainer.py`` (CPU) and ``tests/gpu/test_sharded_trainer_cuda.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fp8rl.config import GRPOConfig, OptimConfig
from fp8rl.quant import QuantSpec
from fp8rl.train.fp8_linear import FP8TrainLinear
from fp8rl.train.trainer import TorchTrainer, TrainerOptions

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from sharded_trainer_worker import fixed_batch  # the two-rank tests' batch

from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("once", [True, False])
def test_gather_once_applies_to_the_fp8_layers_only(tiny_models: dict[str, Path], one_rank: None, once: bool) -> None:
    opts = TrainerOptions(precision="fp8", sharding="fsdp", bf16_first_layers=1, optim=OptimConfig(micro_batch_size=2, fp8_gather_once=once, lr=2e-5, warmup_steps=0))  # fmt: skip
    trainer = TorchTrainer(tiny_models["tiny"], opts)
    layers = list(trainer.model.model.layers)
    assert not any(isinstance(m, FP8TrainLinear) for m in layers[0].modules())  # the BF16 first layer
    # the FP8 layers, and only they, are left unsharded between weight versions (and the root unit, always); their
    # FP8 linears release
    assert trainer.fsdp is not None and trainer.fsdp.held == (layers[1:] if once else []) + [trainer.model]
    fp8 = [m for m in trainer.model.modules() if isinstance(m, FP8TrainLinear)]
    assert fp8 and all(m.release_weight is once for m in fp8)
    batch, adv, old, mask = fixed_batch()
    trainer.compute_logprobs(batch, 1.0)
    # after a forward: gathered FP8 weights released (storage empty) and their FP8 copies cached -- only with once
    assert all((m.weight.untyped_storage().size() == 0) is once for m in fp8)
    assert all((m._reference_weight is not None) is once for m in fp8)
    m = trainer.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0))
    assert m["grad_norm"] > 0
    # the optimizer step dropped the copies and resharded: the weights read afterwards are whole
    assert all(m._reference_weight is None for m in fp8)
    weights = trainer.hf_state_dict()
    assert all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.parametrize("reduce_once", [False, True], ids=["every", "reduce-grads-once"])
def test_only_the_last_micro_batch_backward_waits_for_the_reductions(
    tiny_models: dict[str, Path], one_rank: None, reduce_once: bool
) -> None:
    """Before each micro-batch of a step FSDP2 is told whether its backward is the step's last (only that one makes
    the compute stream wait for the pending reduce-scatters) and, with ``reduce_grads_once``, whether it
    reduce-scatters; read at each micro-batch's forward, for a policy step and an SFT step of 10 rows in 4 + 4 + 2."""
    opts = TrainerOptions(
        precision="bf16",
        sharding="fsdp",
        optim=OptimConfig(micro_batch_size=4, reduce_grads_once=reduce_once, lr=2e-5, warmup_steps=0),
    )
    trainer = TorchTrainer(tiny_models["tiny"], opts)
    seen: list[tuple[bool, bool]] = []

    def record(*_: object) -> None:
        state = trainer.model._get_fsdp_state()  # type: ignore[operator]
        group = state._fsdp_param_group
        seen.append((state._state_ctx.is_last_backward, group.reduce_grads))

    trainer.model.register_forward_pre_hook(record)
    batch, adv, old, mask = fixed_batch()
    trainer.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0))
    trainer.sft_step(batch)
    per_step = [(False, not reduce_once), (False, not reduce_once), (True, True)]
    assert seen == per_step * 2


def test_reference_cache_only_where_the_weight_is_released() -> None:
    """Sharded without gather-once (``cache_until_changed`` alone) the reference path quantizes per call, as before:
    no FP8 copy of the whole model kept on every rank; with ``release_weight`` it keeps W's and W^T's, and a forward
    and backward through them give the per-call path's outputs and gradients exactly."""
    torch.manual_seed(0)
    base = torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16)
    x = torch.randn(6, 256, dtype=torch.bfloat16, requires_grad=True)

    def run(release: bool) -> tuple[FP8TrainLinear, torch.Tensor, torch.Tensor, torch.Tensor]:
        lin = FP8TrainLinear.from_linear(torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16), QuantSpec())
        with torch.no_grad():
            lin.weight.copy_(base.weight)
        lin.cache_until_changed, lin.release_weight = True, release
        xi = x.detach().clone().requires_grad_(True)
        y = lin(xi)
        assert (lin._reference_weight is not None) is release
        y.float().square().sum().backward()
        assert xi.grad is not None and lin.weight.grad is not None
        return lin, y.detach(), xi.grad, lin.weight.grad

    plain, y0, gx0, gw0 = run(False)
    released, y1, gx1, gw1 = run(True)
    assert plain.weight.untyped_storage().size() > 0 and released.weight.untyped_storage().size() == 0
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1)
