"""FSDP2-sharded training (``TrainerOptions.sharding="fsdp"``) on 2 gloo ranks against the one-process trainer.

Each case runs ``sharded_trainer_worker.py`` under ``torch.distributed.run`` (two real processes,
a real gloo process group, real FSDP2) and compares with ``TorchTrainer`` replicated in this
process on the same batch, split into the same micro-batches.  The module's cases run in one launch, one after the
other (``--cases``), each with a fresh trainer.  Documented tolerance: the sharded run sums the same per-micro-batch
fp32 gradients in another order (reduce-scatter per micro-batch instead of one accumulation and
all-reduce), so losses and grad norms agree to 1e-5 relative and the bf16 weights after AdamW to
one bf16 rounding step (most are bit-equal).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8rl.config import GRPOConfig, OptimConfig
from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld
from fp8rl.train.trainer import TorchTrainer, TrainerOptions

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from sharded_trainer_worker import fixed_batch  # noqa: E402

pytestmark = pytest.mark.slow


def _replicated(
    model: Path, precision: str, steps: int, state: dict | None = None, loss_on_every_rank: bool = False
) -> tuple[TorchTrainer, list]:
    trainer = TorchTrainer(
        model, TrainerOptions(precision=precision, optim=OptimConfig(lr=1e-3, micro_batch_size=4, warmup_steps=0))
    )
    if state is not None:
        trainer.load_state_dict(state)
    batch, adv, old, mask = fixed_batch(loss_on_every_rank)
    history = [
        trainer.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0))
        for _ in range(steps)
    ]
    return trainer, history


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name].float(), b[name].float()
        ulp = torch.finfo(torch.bfloat16).eps * y.abs().clamp(min=1e-3)
        assert ((x - y).abs() <= ulp).all(), f"{name}: max diff {(x - y).abs().max():.3g}"


def _assert_same_kv_scales(got: dict, ref: dict) -> None:
    """Same layers; scales to 2% (the sharded forward gathers fp32 masters cast to bf16, the replicated one
    holds bf16 weights: the same values, but the trained weights differ by up to a bf16 rounding)."""
    assert got.keys() == ref.keys() and got
    for layer, s in got.items():
        for kind in "qkv":
            assert getattr(s, kind) == pytest.approx(getattr(ref[layer], kind), rel=2e-2), (layer, kind)


# the cases the tests below compare: name -> the worker's flags
CASES: dict[str, tuple[str, ...]] = {
    "bf16": ("--precision", "bf16"),
    "fp8": ("--precision", "fp8"),
    "resume": ("--steps", "1", "--resume", "{state}"),
    "activation-checkpointing": ("--steps", "1", "--activation-checkpointing"),
    "offload": ("--steps", "2", "--offload-optimizer-state"),
    **{
        f"gather-{when}-{ids}": ("--precision", "fp8", *ckpt, *(() if when == "once" else ("--no-fp8-gather-once",)))
        for ids, ckpt in (("plain", ()), ("checkpointed", ("--activation-checkpointing",)))
        for when in ("once", "every")
    },
    **{
        f"reduce-{when}-{precision}": ("--precision", precision, "--loss-on-every-rank",
                                        *(("--reduce-grads-once",) if when == "once" else ()))
        for precision in ("bf16", "fp8") for when in ("once", "every")
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def sharded(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, Path]]:
    """Every case of CASES on 2 gloo ranks, in one ``torch.distributed.run``: name -> (rank 0's result, its output
    directory).  The resume case starts from the state of one replicated step."""
    model, root = tiny_models["tiny"], tmp_path_factory.mktemp("sharded")
    first, _ = _replicated(model, "bf16", 1)
    torch.save(first.state_dict(), root / "state.pt")
    cases = {name: [str(model), str(root / name), *(f.format(state=root / "state.pt") for f in flags)]
             for name, flags in CASES.items()}  # fmt: skip
    (root / "cases.json").write_text(json.dumps(list(cases.values())))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "sharded_trainer_worker.py"), "--cases", str(root / "cases.json")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: (torch.load(root / name / "result.pt", weights_only=False), root / name) for name in cases}


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_two_sharded_ranks_reproduce_the_replicated_trainer(
    tiny_models: dict[str, Path], sharded: dict[str, tuple[dict, Path]], precision: str
) -> None:
    model = tiny_models["tiny"]
    got, out = sharded[precision]
    fresh = TorchTrainer(model, TrainerOptions(precision=precision, optim=OptimConfig(lr=2e-5, warmup_steps=0)))
    batch, *_ = fixed_batch()
    _assert_same_kv_scales(got["kv_before"], fresh.kv_scales(batch, 0.999, 1.1)[0])
    trainer, history = _replicated(model, precision, 2)
    _assert_same_kv_scales(got["kv_after"], trainer.kv_scales(batch, 0.999, 1.1)[0])
    for a, b in zip(history, got["history"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-8)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["lr"] == a["lr"]
    _assert_same_weights(got["weights"], {k: v.cpu() for k, v in trainer.hf_state_dict().items()})
    ref_lp = trainer.compute_logprobs(batch, 1.0)
    assert got["logprobs"].shape == ref_lp.shape
    assert torch.allclose(got["logprobs"], ref_lp, atol=2e-2)
    # each rank holds about half of the fp32 masters, and AdamW's two moments for that half only
    (local0, state0), (local1, state1) = got["local_sizes"]
    full = sum(p.numel() for p in trainer.model.parameters())
    assert local0 + local1 >= full and max(local0, local1) <= full // 2 + 4096
    assert state0 == 2 * local0 and state1 == 2 * local1
    # the gathered trainer state and weights are kept by rank 0 alone (rank 1 joins the gathers, holds nothing)
    n_params = len(list(trainer.model.parameters()))
    assert got["kept"] == [(n_params, n_params, n_params), (0, 0, 0)]
    # the policy rank 0 saved from the gathered weights loads in transformers as the same weights
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out / "policy", dtype=torch.bfloat16)
    for name, p in saved.named_parameters():
        assert torch.equal(p.detach(), got["weights"][name]), name


def test_resume_crosses_between_sharded_and_replicated(
    tiny_models: dict[str, Path], sharded: dict[str, tuple[dict, Path]]
) -> None:
    """The trainer state has one layout: a replicated step resumes sharded, and a sharded state resumes
    replicated, landing where an unbroken replicated run lands."""
    model = tiny_models["tiny"]
    got, _ = sharded["resume"]  # from the state of one replicated step (the fixture)
    straight, history = _replicated(model, "bf16", 2)
    assert got["history"][0]["loss"] == pytest.approx(history[1]["loss"], rel=1e-5)
    _assert_same_weights(got["weights"], {k: v.cpu() for k, v in straight.hf_state_dict().items()})
    assert got["state"]["step_count"] == 2
    # and back: the sharded state (full tensors) into a replicated trainer gives exactly those weights
    back = TorchTrainer(model, TrainerOptions(optim=OptimConfig(lr=1e-3, micro_batch_size=4, warmup_steps=0)))
    back.load_state_dict(got["state"])
    for name, w in back.hf_state_dict().items():
        assert torch.equal(w.cpu(), got["weights"][name]), name


def test_activation_checkpointing_changes_memory_not_numbers(
    tiny_models: dict[str, Path], sharded: dict[str, tuple[dict, Path]]
) -> None:
    model = tiny_models["tiny"]
    got, _ = sharded["activation-checkpointing"]
    _trainer, history = _replicated(model, "bf16", 1)
    assert got["history"][0]["loss"] == pytest.approx(history[0]["loss"], rel=1e-5)
    assert got["history"][0]["grad_norm"] == pytest.approx(history[0]["grad_norm"], rel=1e-5)


def test_optimizer_state_offload_changes_memory_not_numbers(
    tiny_models: dict[str, Path], sharded: dict[str, tuple[dict, Path]]
) -> None:
    """``optim.offload_optimizer_state`` with FSDP2: AdamW's sharded moments leave the device after every step
    (their storage is empty there) and come back for the next; the run, and its gathered state, are the same
    as without it."""
    model = tiny_models["tiny"]
    got, _ = sharded["offload"]
    trainer, history = _replicated(model, "bf16", 2)
    for a, b in zip(history, got["history"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-8)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["state_device_bytes"] == 0
    _assert_same_weights(got["weights"], {k: v.cpu() for k, v in trainer.hf_state_dict().items()})
    # the state gathered while offloaded is the state: it resumes a replicated trainer onto the same weights
    ref_masters, ref_optim = trainer.optimizer.full_state()
    assert len(got["state"]["masters"]) == len(ref_masters)
    for i, s in ref_optim["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["state"]["optimizer"]["state"][i][k], s[k].cpu(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_fp8_gather_once_changes_the_gathers_not_the_numbers(
    tiny_models: dict[str, Path], sharded: dict[str, tuple[dict, Path]], checkpointing: bool
) -> None:
    """``optim.fp8_gather_once`` (the default): the FP8 linears' cached copies serve every micro-batch, so FSDP2
    gathers each decoder layer once per weight version instead of for every forward and backward (with activation
    checkpointing, the recompute's as well); the losses, gradient norms and trained weights are exactly those of
    the run that gathers every time."""
    model = tiny_models["tiny"]
    ids = "checkpointed" if checkpointing else "plain"  # --precision fp8 [--activation-checkpointing]
    (once, _), (every, _) = sharded[f"gather-once-{ids}"], sharded[f"gather-every-{ids}"]
    for a, b in zip(every["history"], once["history"], strict=True):
        assert (b["loss"], b["grad_norm"]) == (a["loss"], a["grad_norm"])
        assert b["all_gathers"] < a["all_gathers"], (b["all_gathers"], a["all_gathers"])
    for name, w in every["weights"].items():
        assert torch.equal(once["weights"][name], w), name
    assert torch.equal(once["logprobs"], every["logprobs"])
    # rank 0 runs two micro-batches a step: gathering every time costs two forwards' and two backwards' gathers of
    # every layer (the recompute uses the backward's); once, one gather of each layer; the root unit is gathered
    # once a step either way (it stays gathered across the micro-batches)
    layers = TorchTrainer(
        model, TrainerOptions(optim=OptimConfig(lr=2e-5, warmup_steps=0))
    ).model.config.num_hidden_layers
    assert all(h["all_gathers"] == 4 * layers + 1 for h in every["history"]), every["history"]
    assert all(h["all_gathers"] == layers + 1 for h in once["history"]), once["history"]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_reduce_grads_once_changes_the_reduce_scatters_not_the_step(
    tiny_models: dict[str, Path], sharded: dict[str, tuple[dict, Path]], precision: str
) -> None:
    """``optim.reduce_grads_once``: the micro-batches' gradients accumulate unsharded in fp32 and are reduce-scattered
    once a step, in the last micro-batch's backward; each rank's gradient shard is the same sum in another order, so
    the run lands where the run that reduce-scatters every micro-batch lands (losses equal, grad norms to 1e-6, the
    weights to a bf16 rounding step). Rank 0 runs two micro-batches a step, rank 1 one and a padding one, both with
    loss tokens (so the reduce-scatter sums two ranks' accumulated gradients)."""
    model = tiny_models["tiny"]
    # --precision PRECISION --loss-on-every-rank, with and without --reduce-grads-once
    (once, _), (every, _) = sharded[f"reduce-once-{precision}"], sharded[f"reduce-every-{precision}"]
    units = (
        TorchTrainer(model, TrainerOptions(optim=OptimConfig(lr=2e-5, warmup_steps=0))).model.config.num_hidden_layers
        + 1
    )  # the layers and the root
    for a, b in zip(every["history"], once["history"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-9)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
        assert a["reduce_scatters"] == 2 * units and b["reduce_scatters"] == units, (a, b)
    _assert_same_weights(once["weights"], every["weights"])
    trainer, history = _replicated(model, precision, 2, loss_on_every_rank=True)  # and where the replicated one lands
    for a, b in zip(history, once["history"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-8)
    _assert_same_weights(once["weights"], {k: v.cpu() for k, v in trainer.hf_state_dict().items()})
