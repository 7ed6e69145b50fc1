"""``optim.offload_optimizer_state``: AdamW's moments in host memory between steps (``fp8rl.train.optim.StateOffload``).

The replicated trainer on the CPU (the sharded one is ``tests/integration/test_sharded_trainer.py``, the GPU's
pinned copies ``tests/gpu/test_optimizer_offload_cuda.py``): the same steps with and without it give the same
bytes, the moments' storage is empty between steps, and checkpoints cross between the two."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8rl.build import trainer_options
from fp8rl.config import ConfigError, GRPOConfig, OptimConfig, load_recipe, parse_run_config
from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld
from fp8rl.train.optim import StateOffload
from fp8rl.train.trainer import TorchTrainer, TrainerOptions, build_batch


def _batch() -> tuple:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 20, (4,), generator=g).tolist() for _ in range(6)]
    responses = torch.randint(3, 20, (6, 5), generator=g)
    mask = torch.ones(6, 5)
    advantages, old = torch.randn(6, generator=g), -torch.rand(6, 5, generator=g)
    return build_batch(prompts, responses, mask, pad_id=0), advantages, old, mask


def _steps(trainer: TorchTrainer, n: int, timings: bool = False) -> list[dict[str, float]]:
    """``n`` policy steps' metrics (without the seconds the offload took, which differ run to run)."""
    batch, adv, old, mask = _batch()
    out = [
        trainer.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0)) for _ in range(n)
    ]
    return out if timings else [{k: v for k, v in m.items() if k != "optimizer_offload_s"} for m in out]


def _moments(trainer: TorchTrainer) -> list[torch.Tensor]:
    state = trainer.optimizer.optimizer.state
    return [t for s in state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]


def _trainer(model: Path, offload: bool) -> TorchTrainer:
    return TorchTrainer(
        model,
        TrainerOptions(optim=OptimConfig(lr=1e-3, micro_batch_size=4, offload_optimizer_state=offload, warmup_steps=0)),
    )


def test_offloaded_moments_give_the_same_steps(tiny_models: dict[str, Path]) -> None:
    plain, offloaded = _trainer(tiny_models["tiny"], False), _trainer(tiny_models["tiny"], True)
    assert _steps(plain, 3) == _steps(offloaded, 3)
    for name, w in plain.hf_state_dict().items():
        assert torch.equal(w, offloaded.hf_state_dict()[name]), name
    # between steps the moments hold no storage where they live; the host copies hold their values
    moments = _moments(offloaded)
    assert moments and all(t.untyped_storage().nbytes() == 0 for t in moments)
    offload = offloaded.optimizer.offload
    assert isinstance(offload, StateOffload) and offload.on_host
    offload.to_device()
    for a, b in zip(_moments(plain), _moments(offloaded), strict=True):
        assert torch.equal(a, b)
    offload.to_host()
    assert all(t.untyped_storage().nbytes() == 0 for t in _moments(offloaded))


def test_checkpoints_cross_between_offloaded_and_resident_state(tiny_models: dict[str, Path]) -> None:
    model = tiny_models["tiny"]
    offloaded = _trainer(model, True)
    _steps(offloaded, 1)
    state = offloaded.state_dict()  # taken while the moments are on the host
    assert all(t.untyped_storage().nbytes() == 0 for t in _moments(offloaded))  # and sent back after
    resident = _trainer(model, False)
    resident.load_state_dict(state)
    again = _trainer(model, True)
    again.load_state_dict(state)
    assert all(t.untyped_storage().nbytes() == 0 for t in _moments(again))  # a loaded state goes to the host too
    expected = _steps(offloaded, 1)
    assert _steps(resident, 1) == expected
    assert _steps(again, 1) == expected


def test_the_run_config_turns_it_on() -> None:
    cfg = parse_run_config(
        {"recipe": load_recipe("bf16").model_dump(), "optim": {"offload_optimizer_state": True}}, "test"
    )
    assert trainer_options(cfg).optim.offload_optimizer_state
    with pytest.raises(ConfigError, match="offload_optimizer_state"):
        parse_run_config(
            {"recipe": load_recipe("bf16").model_dump(), "optim": {"offload_optimizer_state": "sometimes"}}, "test"
        )


def test_fp8_linears_drop_their_cached_weights_before_the_step(tiny_models: dict[str, Path]) -> None:
    """The FP8 weight operands a fused linear caches (on GPUs; here planted) are gone when AdamW steps, so they
    do not add to the step's memory peak; the step itself is unchanged."""
    from fp8rl.train.fp8_linear import FP8TrainLinear

    trainer = TorchTrainer(
        tiny_models["tiny"],
        TrainerOptions(precision="fp8", optim=OptimConfig(lr=1e-3, micro_batch_size=4, warmup_steps=0)),
    )
    linears = [m for m in trainer.model.modules() if isinstance(m, FP8TrainLinear)]
    assert linears
    seen: list[bool] = []
    step = trainer.optimizer.step

    def checked(grad_clip: float, grad_scale: float = 1.0) -> float:
        seen.append(all(m._fused_weight is None for m in linears))
        return step(grad_clip, grad_scale)

    trainer.optimizer.step = checked  # type: ignore[method-assign]
    for m in linears:
        m._fused_weight = object()  # type: ignore[assignment]  # what a GPU forward would have cached
    _steps(trainer, 1)
    assert seen == [True]


def test_a_step_reports_what_its_memory_handling_cost(tiny_models: dict[str, Path]) -> None:
    """``optimizer_offload_s`` when offloading (the copies both ways; not a checkpoint's between steps), nothing
    without it; ``cuda_alloc_retries`` only on CUDA; a Ray trainer group reports the slowest rank's."""
    from fp8rl.cluster.groups import combine_rank_metrics

    plain, offloaded = _trainer(tiny_models["tiny"], False), _trainer(tiny_models["tiny"], True)
    (m_plain,) = _steps(plain, 1, timings=True)
    (m_off,) = _steps(offloaded, 1, timings=True)
    assert "optimizer_offload_s" not in m_plain and "cuda_alloc_retries" not in m_plain
    assert m_off["optimizer_offload_s"] > 0  # the first step's moments went to the host
    offload = offloaded.optimizer.offload
    assert offload is not None
    offloaded.state_dict()  # copies between steps (a checkpoint) ...
    assert offload.seconds > 0
    offload.seconds += 1000.0  # ... marked, so that a step counting them would show it
    (m_next,) = _steps(offloaded, 1, timings=True)
    assert 0 < m_next["optimizer_offload_s"] < 1000.0 and offload.seconds == 0.0
    ranks = [{"loss": 0.5, "grad_norm": 2.0, "lr": 1e-3, "optimizer_offload_s": 1.5, "cuda_alloc_retries": 0.0},
             {"loss": 0.25, "grad_norm": 2.0, "lr": 1e-3, "optimizer_offload_s": 2.5, "cuda_alloc_retries": 3.0}]  # fmt: skip
    assert combine_rank_metrics(ranks) == {
        "loss": 0.75, "grad_norm": 2.0, "lr": 1e-3, "optimizer_offload_s": 2.5, "cuda_alloc_retries": 3.0
    }  # fmt: skip
