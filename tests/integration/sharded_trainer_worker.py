"""One rank of ``test_sharded_trainer.py``: run under ``torch.distributed.run`` (gloo on CPU).

Every rank builds a ``TorchTrainer`` with ``sharding="fsdp"`` over the default process group,
takes its contiguous rows of one fixed batch (uneven on purpose: rank 0 runs two
micro-batches, rank 1 one with no loss tokens, then a padding one), runs policy steps, and
rank 0 writes what the test compares with the one-process replicated trainer: per-step
metrics summed over ranks, FP8 KV-cache scales (before the first forward and after the steps), logprobs, the gathered weights, the full trainer state, and a saved
checkpoint.  With ``--resume STATE`` it first loads a (replicated) trainer state.  With ``--count-syncs`` (CUDA) each
rank also records where its policy steps and logprob pass synchronised with the GPU (``cuda_syncs.record_syncs``).

``--cases FILE`` runs several cases in one launch, one after the other in the same process group: FILE is a JSON
list of argument lists (``[MODEL, OUT, *flags]``), each a fresh trainer.  Two processes importing torch and
transformers cost more than a tiny model's steps, so the CPU tests launch once for all their cases.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fp8rl.config import GRPOConfig, OptimConfig
from fp8rl.quant import QuantSpec
from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld
from fp8rl.train.trainer import SequenceBatch, TorchTrainer, TrainerOptions, build_batch

ROWS, PROMPT, RESPONSE, VOCAB = 10, 5, 6, 20


def fixed_batch(loss_on_every_rank: bool = False) -> tuple[SequenceBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """10 rows of prompts + responses, advantages, old logprobs and a loss mask (rows 8-9 masked out, unless
    ``loss_on_every_rank``: then rank 1's rows have loss tokens too)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (PROMPT - i % 3,), generator=g).tolist() for i in range(ROWS)]
    responses = torch.randint(3, VOCAB, (ROWS, RESPONSE), generator=g)
    mask = torch.ones(ROWS, RESPONSE)
    mask[1, 4:] = 0
    batch = build_batch(prompts, responses, mask, pad_id=0)
    advantages = torch.randn(ROWS, generator=g)
    old = -torch.rand(ROWS, RESPONSE, generator=g) * 3
    loss_mask = mask.clone()
    if not loss_on_every_rank:
        loss_mask[8:] = 0  # the only micro-batch of rank 1 (rows 8-9): no loss tokens
    return batch, advantages, old, loss_mask


def rank_rows(rank: int, world: int) -> slice:
    # world 2: rank 0 runs rows 0-3 and 4-7, rank 1 rows 8-9: the micro-batches of one process taking all 10
    # rows 4 at a time (FP8's wgrad quantizes along the tokens, so its gradient depends on the micro-batches)
    if world == 1:
        return slice(0, ROWS)
    return slice(0, 8) if rank == 0 else slice(8, ROWS)


def _state_device_bytes(trainer: TorchTrainer) -> int:
    """Bytes of storage AdamW's moments hold where they live (0 while offloaded to the host)."""
    from torch.distributed.tensor import DTensor

    return sum(
        (v.to_local() if isinstance(v, DTensor) else v).untyped_storage().nbytes()
        for s in trainer.optimizer.optimizer.state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )  # fmt: skip


def _count_calls(name: str) -> list[int]:
    """Count the calls of ``torch.distributed.<name>`` from now on (FSDP2's parameter all-gathers are
    ``all_gather_into_tensor``, its gradient reduce-scatters ``reduce_scatter_tensor``)."""
    count = [0]
    real = getattr(dist, name)

    def counted(*args: object, **kwargs: object) -> object:
        count[0] += 1
        return real(*args, **kwargs)

    setattr(dist, name, counted)
    return count


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--backend", default="torch", help="torch | te (TransformerEngine linears: a GPU with TE)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--offload-optimizer-state", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) | cuda (NCCL, one GPU per rank)")
    ap.add_argument("--no-fp8-gather-once", action="store_true", help="OptimConfig.fp8_gather_once=False")
    ap.add_argument("--compile-elementwise", action="store_true")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--count-syncs", action="store_true", help="record each rank's synchronisations (CUDA)")
    ap.add_argument("--reduce-grads-once", action="store_true", help="OptimConfig.reduce_grads_once=True")
    ap.add_argument("--granularity", default="block", help="the FP8 recipe's quant.granularity (block | row | tensor)")
    ap.add_argument("--loss-on-every-rank", action="store_true", help="fixed_batch(loss_on_every_rank=True)")
    return ap


def main() -> None:
    if sys.argv[1:2] == ["--cases"]:
        cases = [_parser().parse_args(argv) for argv in json.loads(Path(sys.argv[2]).read_text())]
    else:
        cases = [_parser().parse_args()]
    counters = _count_calls("all_gather_into_tensor"), _count_calls("reduce_scatter_tensor")
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cases[0].device == "cuda" else cases[0].device
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # NCCL's object collectives use the current device
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    for args in cases:
        run_case(args, device, *counters)
    dist.destroy_process_group()


def run_case(args: argparse.Namespace, device: str, gathers: list[int], scatters: list[int]) -> None:
    """One case (a fresh trainer) in the process group that is already up."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opts = TrainerOptions(precision=args.precision, sharding="fsdp", backend=args.backend, spec=QuantSpec(granularity=args.granularity), optim=OptimConfig(lr=1e-3, micro_batch_size=args.micro_batch_size, activation_checkpointing=args.activation_checkpointing, offload_optimizer_state=args.offload_optimizer_state, fp8_gather_once=not args.no_fp8_gather_once, compile_elementwise=args.compile_elementwise, reduce_grads_once=args.reduce_grads_once, warmup_steps=0))  # fmt: skip
    trainer: TorchTrainer
    if args.backend == "te":
        from fp8rl.train.te_trainer import TETrainer

        trainer = TETrainer(args.model, opts, device=device)
    else:
        trainer = TorchTrainer(args.model, opts, device=device)
    if args.resume:
        trainer.load_state_dict(torch.load(args.resume, weights_only=False))
    batch, adv, old, mask = fixed_batch(args.loss_on_every_rank)
    rows = rank_rows(rank, world)
    # FP8 KV-cache scales before any forward (the FSDP state is not initialised yet) and after the steps
    kv_before = trainer.kv_scales(batch, 0.999, 1.1)[0]
    history = []
    syncs: list[list[str]] = []  # this rank's, per policy step, then the logprob pass (--count-syncs)

    # this rank's rows, with the whole batch's totals (TrainerGroup.policy_step's split)
    rank_step = PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0).rows(rows)

    def step() -> dict[str, float]:
        return trainer.policy_step(rank_step)

    for _ in range(args.steps):
        before, scattered = gathers[0], scatters[0]
        if args.count_syncs:
            from cuda_syncs import record_syncs

            got: list[dict[str, float]] = []
            syncs.append(record_syncs(lambda got=got: got.append(step())))  # type: ignore[misc]
            m = got[0]
        else:
            m = step()
        parts: list[dict[str, float] | None] = [None] * world
        dist.all_gather_object(parts, m)
        summed = {k: sum(p.get(k, 0.0) for p in parts if p) for k in m}
        summed["grad_norm"], summed["lr"] = m["grad_norm"], m["lr"]
        summed["state_device_bytes"] = float(_state_device_bytes(trainer))  # this rank's, after the step
        summed["all_gathers"] = float(gathers[0] - before)  # this rank's FSDP2 all-gathers in the step
        summed["reduce_scatters"] = float(scatters[0] - scattered)  # and its gradient reduce-scatters
        history.append(summed)
    kv_after = trainer.kv_scales(batch, 0.999, 1.1)[0]
    lp_parts: list[torch.Tensor | None] = [None] * world
    if args.count_syncs:
        from cuda_syncs import record_syncs

        lps: list[torch.Tensor] = []
        syncs.append(record_syncs(lambda: lps.append(trainer.compute_logprobs(batch.slice(rows), 1.0))))
        dist.all_gather_object(lp_parts, lps[0])
    else:
        dist.all_gather_object(lp_parts, trainer.compute_logprobs(batch.slice(rows), 1.0))
    rank_syncs: list[list[list[str]] | None] = [None] * world
    dist.all_gather_object(rank_syncs, syncs)
    from torch.distributed.tensor import DTensor

    weights = {k: v.cpu() for k, v in trainer.hf_state_dict().items()}
    # counted after the gather: a forward leaves layers unsharded under fp8_gather_once until the weights are read
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in trainer.model.parameters())
    state_local = sum(
        v.to_local().numel() for s in trainer.optimizer.optimizer.state.values() for v in s.values()
        if isinstance(v, DTensor)
    )  # fmt: skip
    sizes: list[tuple[int, int] | None] = [None] * world
    dist.all_gather_object(sizes, (local, state_local))
    state = trainer.state_dict()
    kept: list[tuple[int, int, int] | None] = [None] * world  # what each rank holds of the gathered state
    mine = (len(state["masters"]), len(state["optimizer"]["state"]), len(trainer.hf_state_dict(keep=rank == 0)))
    dist.all_gather_object(kept, mine)
    out = Path(args.out)
    trainer.save(out / "policy")
    if rank == 0:
        torch.save(
            {"history": history, "logprobs": torch.cat([t for t in lp_parts if t is not None]), "weights": weights,
             "state": state, "local_sizes": sizes, "kv_before": kv_before, "kv_after": kv_after,
             "kept": kept, "syncs": rank_syncs},
            out / "result.pt",
        )  # fmt: skip
    dist.barrier()  # the next case starts with every rank done with this one


if __name__ == "__main__":
    main()
