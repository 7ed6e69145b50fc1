"""The RL step on Ray: the one-process loop (``fp8rl.loop.run_rl``) driving Ray actors.

``run_rl_on_ray`` places ``trainer_workers`` data-parallel trainer actors and
``rollout_workers`` rollout actors (``fp8rl.cluster.workers``) in one placement group and
hands ``run_rl`` a ``RayParts`` whose engine and trainer forward to them, so the loop
computes what it computes in one process.  Layouts:

- ``split``: one bundle per actor (a GPU each where the cluster has GPUs);
- ``colocated``: trainer rank i and rollout worker i share bundle i; the engines sleep
  (give their device memory back) after each generation and wake up for the weight sync.

Where Ray comes from: ``RayConfig.address``, else ``RAY_ADDRESS``, else a local Ray started
here (logical CPUs at least the number of actors, object store capped, dashboard and
usage stats off) and shut down at the end.  Ray 2.59+ turns on token auth for a local
cluster it starts, and the driver started it, so it holds the token: nothing to hand over.

Faults: every wait on an actor has a timeout (``RayConfig.actor_timeout_s``) and names the
actor; an exception inside an actor is re-raised as ``WorkerError`` with the actor's name
and the original exception chained; a dead actor (killed, OOM, node lost) makes the
driver replace every actor and resume from the last checkpoint, at most
``RayConfig.max_restarts`` times (which needs ``checkpoint_every`` and a checkpoint dir).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from fp8rl.config import GRPOConfig, RayConfig, RunConfig
from fp8rl.errors import UserError
from fp8rl.loop import RLResult, run_rl
from fp8rl.models.loading import load_tokenizer
from fp8rl.rollout.base import Rollout, SamplingParams
from fp8rl.rollout.kv_calibration import kv_scale_metrics
from fp8rl.sync import SyncStats
from fp8rl.tracking import MetricsSink
from fp8rl.train.trainer import SequenceBatch, policy_batch_totals


class WorkerError(RuntimeError):
    """An actor raised; the message names the actor and the call, the original is chained."""


class WorkerDied(RuntimeError):
    """An actor is gone (killed, out of memory, node lost); the driver may replace it and resume."""


class WorkerTimeout(UserError):
    """An actor did not answer within ``RayConfig.actor_timeout_s``."""


@dataclass
class _Calls:
    """Waits on actor calls with a deadline, translating Ray's failures into ours."""

    timeout_s: float

    def get(self, refs: Any, what: str | Sequence[str]) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except GetTimeoutError:
            raise WorkerTimeout(f"{_names(what)} did not answer within {self.timeout_s:g}s") from None
        except RayActorError as e:
            raise WorkerDied(f"{_names(what)}: actor died: {e}") from e
        except RayTaskError as e:
            cause = getattr(e, "cause", None) or e
            raise WorkerError(f"{_names(what)} raised {type(cause).__name__}: {cause}") from cause


def _names(what: str | Sequence[str]) -> str:
    return what if isinstance(what, str) else ", ".join(what)


def _row_chunks(n: int, parts: int) -> list[slice]:
    """Contiguous, near-equal row ranges (the first ones one longer), empty ones dropped."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        if size:
            out.append(slice(start, start + size))
        start += size
    return out


def _cat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """One rollout from several workers' rollouts of consecutive prompt chunks (responses right-padded)."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.response_ids.shape[1] for p in parts)

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return Rollout(
        prompt_ids=[ids for p in parts for ids in p.prompt_ids],
        response_ids=torch.cat([pad(p.response_ids, pad_id) for p in parts]),
        response_mask=torch.cat([pad(p.response_mask, 0.0) for p in parts]),
        logprobs=torch.cat([pad(p.logprobs, 0.0) for p in parts]),
        finished=torch.cat([p.finished for p in parts]),
        policy_version=min(p.policy_version for p in parts),
    )


@dataclass
class RolloutGroup:
    """The rollout workers behind the ``RolloutEngine`` methods the loop uses."""

    actors: list[Any]
    calls: _Calls
    colocated: bool
    pad_token_id: int
    policy_version: int = 0
    names: list[str] = field(default_factory=list)
    # colocated vLLM engines: the device memory their last sleep freed, summed over the workers
    sleep_freed_bytes: int | None = None

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> Rollout:
        self.wake_up()
        chunks = _row_chunks(len(prompt_ids), len(self.actors))
        refs = []
        for i, (actor, rows) in enumerate(zip(self.actors, chunks, strict=False)):
            # each worker samples its chunk with a seed of its own, fixed by the chunk's position
            params = SamplingParams(**{**sampling.__dict__, "seed": sampling.seed + 7919 * i})
            refs.append(actor.generate.remote(prompt_ids[rows], params))
        rollouts = self.calls.get(refs, [f"{n}.generate" for n in self.names[: len(refs)]])
        self.sleep()
        return _cat_rollouts(rollouts, self.pad_token_id)

    def wake_up(self) -> None:
        """Colocated engines take their device memory back (generation, weight loads); no-op when split."""
        if self.colocated:
            self.calls.get([a.wake_up.remote() for a in self.actors], self.names)

    def sleep(self) -> None:
        """Colocated engines give their device memory to training; no-op when split."""
        if self.colocated:
            freed = self.calls.get([a.sleep.remote() for a in self.actors], self.names)
            measured = [f for f in freed if f is not None]
            self.sleep_freed_bytes = sum(measured) if measured else None


@dataclass
class TrainerGroup:
    """The data-parallel trainer workers behind the trainer methods the loop uses."""

    actors: list[Any]
    calls: _Calls
    names: list[str] = field(default_factory=list)
    # fsdp: every rank takes part in every forward and in every gather of the full weights
    sharded: bool = False

    def lead(self, method: str, *args: Any) -> Any:
        """``method`` on rank 0, whose answer counts; sharded, on every rank (a collective), rank 0 answering."""
        if not self.sharded:
            return self.calls.get(getattr(self.actors[0], method).remote(*args), f"{self.names[0]}.{method}")
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        return self.calls.get(refs, [f"{n}.{method}" for n in self.names])[0]

    def compute_logprobs(self, batch: SequenceBatch, temperature: float) -> torch.Tensor:
        chunks = _row_chunks(batch.input_ids.shape[0], len(self.actors))
        if self.sharded:  # a rank with no rows still joins the forwards' all-gathers
            n = batch.input_ids.shape[0]
            chunks += [slice(n, n)] * (len(self.actors) - len(chunks))
        refs = [
            a.compute_logprobs.remote(batch.slice(rows), temperature)
            for a, rows in zip(self.actors, chunks, strict=False)
        ]
        return torch.cat(self.calls.get(refs, [f"{n}.compute_logprobs" for n in self.names[: len(refs)]]))

    def policy_step(
        self,
        batch: SequenceBatch,
        advantages: torch.Tensor,
        old_logprobs: torch.Tensor,
        is_weights: torch.Tensor | None,
        loss_mask: torch.Tensor,
        loss_cfg: GRPOConfig,
        temperature: float,
    ) -> dict[str, float]:
        totals = policy_batch_totals(loss_mask)
        # every rank takes part in the gradient all-reduce, so every rank gets rows
        chunks = _row_chunks(batch.input_ids.shape[0], len(self.actors))
        if len(chunks) < len(self.actors):
            raise ValueError(f"a batch of {batch.input_ids.shape[0]} rows cannot feed {len(self.actors)} trainer ranks")
        refs = [
            a.policy_step.remote(
                batch.slice(rows),
                advantages[rows],
                old_logprobs[rows],
                None if is_weights is None else is_weights[rows],
                loss_mask[rows],
                loss_cfg,
                temperature,
                totals,
            )
            for a, rows in zip(self.actors, chunks, strict=True)
        ]
        per_rank: list[dict[str, float]] = self.calls.get(refs, [f"{n}.policy_step" for n in self.names])
        # each rank's loss and metrics are its exact share of the global ones; norm and lr are global
        out = {k: sum(m.get(k, 0.0) for m in per_rank) for k in per_rank[0]}
        for global_key in ("grad_norm", "lr"):
            out[global_key] = per_rank[0][global_key]
        return out

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self.lead("state_dict")
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import ray

        ref = ray.put(state)
        self.calls.get([a.load_state_dict.remote(ref) for a in self.actors], self.names)


@dataclass
class RayParts:
    """``fp8rl.loop.Parts`` on Ray actors, with object-store weight sync."""

    tok: PreTrainedTokenizerBase
    bf16_bytes: int
    engine: RolloutGroup
    trainer: TrainerGroup
    model_dir: str
    verify: bool
    placement_group: Any
    fp8_names: list[str]
    # set when RayConfig.sync is "collective": what the broadcast carries, agreed once
    sync_layout: Any = None
    kv_cache: str = "bf16"  # the recipe's; fp8: calibrate_kv recalibrates the engines' scales
    ipc: bool = False  # RayConfig.sync "ipc": each rollout worker maps its trainer rank's packed payload

    def calibrate_kv(self, batch: SequenceBatch) -> dict[str, float]:
        """FP8 KV cache: scales from trainer rank 0's policy (every rank's forward when sharded), written into
        every engine; ``kv/...`` metrics.  ``{}`` for a bf16 KV cache."""
        if self.kv_cache != "fp8":
            return {}
        scales, seconds = self.trainer.lead("kv_scales", batch)
        self.engine.wake_up()
        self.engine.calls.get([a.set_kv_scales.remote(scales) for a in self.engine.actors], self.engine.names)
        self.engine.sleep()
        return kv_scale_metrics(scales, seconds)

    def push_weights(self, version: int) -> SyncStats:
        if self.sync_layout is not None:
            return self._push_collective(version)
        if self.ipc:
            return self._push_ipc(version)
        t0 = time.perf_counter()
        # requantized once, on trainer rank 0; the payload stays in the object store and each
        # rollout worker fetches it by reference (sharded: every rank joins the gather of the weights)
        trainers = self.trainer.actors if self.trainer.sharded else self.trainer.actors[:1]
        payload_refs = [a.rollout_payload.remote(self.fp8_names) for a in trainers]
        self.engine.wake_up()
        loads = [a.load_weights.remote(payload_refs[0], version, self.verify) for a in self.engine.actors]
        sizes = self.engine.calls.get(loads, [f"{n}.load_weights" for n in self.engine.names])
        self.trainer.calls.get(payload_refs[1:], [f"{n}.rollout_payload" for n in self.trainer.names[1:]])
        self.engine.sleep()
        self.engine.policy_version = version
        seconds = time.perf_counter() - t0
        return SyncStats(version, int(sizes[0]), len(self.fp8_names), 0.0, seconds, self.verify)

    def _push_collective(self, version: int) -> SyncStats:
        """Trainer rank 0 broadcasts in buckets; every rollout worker receives into its engine in place."""
        engine = self.engine
        engine.wake_up()
        trainers = self.trainer.actors if self.trainer.sharded else self.trainer.actors[:1]
        sends = [a.push_weights.remote(version) for a in trainers]
        receives = [a.receive_weights.remote(self.sync_layout, version) for a in engine.actors]
        t_names = [f"{n}.push_weights" for n in self.trainer.names[: len(sends)]]
        sent, *_rest = engine.calls.get([*sends, *receives], [*t_names, *engine.names])
        engine.sleep()
        engine.policy_version = version
        nbytes, requant_s, transfer_s = sent
        return SyncStats(version, int(nbytes), len(self.fp8_names), requant_s, transfer_s, self.verify)

    def _push_ipc(self, version: int) -> SyncStats:
        """Trainer rank i packs its requantized payload into a device buffer; rollout worker i, on the same GPU,
        maps it through CUDA IPC and loads from it; then the buffers are freed (sharded: every rank joins the
        gather, rank 0 shares)."""
        engine, trainer = self.engine, self.trainer
        senders = trainer.actors if trainer.sharded else trainer.actors[: len(engine.actors)]
        names = trainer.names[: len(senders)]
        shared = trainer.calls.get([a.share_rollout_payload.remote(self.fp8_names) for a in senders],
                                   [f"{n}.share_rollout_payload" for n in names])  # fmt: skip
        try:
            engine.wake_up()
            loads = [a.load_shared.remote(shared[i][0], version, self.verify) for i, a in enumerate(engine.actors)]
            loaded = engine.calls.get(loads, [f"{n}.load_shared" for n in engine.names])
        finally:
            trainer.calls.get([a.release_shared.remote() for a in senders], [f"{n}.release_shared" for n in names])
        engine.sleep()
        engine.policy_version = version
        requant_s = max(s[1] for s in shared if s is not None)
        return SyncStats(
            version, int(loaded[0][0]), len(self.fp8_names), requant_s, max(b[1] for b in loaded), self.verify
        )

    def save_policy(self, output_dir: str | Path) -> None:
        self.trainer.lead("save_policy", str(output_dir), self.model_dir)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.trainer.actors + self.engine.actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.placement_group)


CPUS_PER_BUNDLE = 1.0


def _bundles(rc: RayConfig, use_gpu: bool) -> list[dict[str, float]]:
    count = (
        max(rc.trainer_workers, rc.rollout_workers)
        if rc.layout == "colocated"
        else rc.trainer_workers + rc.rollout_workers
    )
    bundle = {"CPU": CPUS_PER_BUNDLE, **({"GPU": 1.0} if use_gpu else {})}
    return [dict(bundle) for _ in range(count)]


def _bundle_index(rc: RayConfig, role: str, i: int) -> int:
    if rc.layout == "colocated":
        return i % max(rc.trainer_workers, rc.rollout_workers)
    return i if role == "trainer" else rc.trainer_workers + i


@dataclass
class _Placement:
    """The placement group of one RL step, and the Ray options that put each actor in its bundle."""

    rc: RayConfig
    group: Any
    use_gpu: bool
    prefix: str  # actors are named, so an operator (or a test) can find them: ray.util.list_named_actors()

    @property
    def device(self) -> str:
        return "cuda" if self.use_gpu else "cpu"

    def options(self, role: str, i: int, actor: bool = True) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        share = 0.5 if self.rc.layout == "colocated" else 1.0
        index = _bundle_index(self.rc, role, i)
        opts: dict[str, Any] = {
            "num_cpus": CPUS_PER_BUNDLE * share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index),
        }
        if actor:
            opts |= {"num_gpus": share if self.use_gpu else 0, "name": f"{self.prefix}{role}-{i}", "max_restarts": 0}
        return opts


def _place(rc: RayConfig, calls: _Calls) -> _Placement:
    import ray
    from ray.util.placement_group import placement_group

    use_gpu = ray.cluster_resources().get("GPU", 0) >= len(_bundles(rc, True))
    group = placement_group(_bundles(rc, use_gpu), strategy="PACK")
    calls.get(group.ready(), "placement group (are enough CPUs/GPUs free?)")
    return _Placement(rc, group, use_gpu, f"fp8rl-{uuid.uuid4().hex[:8]}-")


def _start_actors(
    cfg: RunConfig, model_dir: str | Path, where: _Placement, calls: _Calls
) -> tuple[list[Any], list[Any]]:
    """Trainer ranks (joined in one process group) and rollout workers, each constructed and answering."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from fp8rl.cluster.workers import RolloutWorker, TrainerWorker, node_address

    rc, cfg_data, model = where.rc, cfg.model_dump(mode="json"), str(model_dir)
    threads = max(1, (os.cpu_count() or 1) // (rc.trainer_workers + rc.rollout_workers))
    address = ray.remote(node_address).options(**where.options("trainer", 0, actor=False)).remote()
    init_method = "tcp://{}:{}".format(*calls.get(address, "trainer-0 address"))
    n, device = rc.trainer_workers, where.device
    trainer_cls, rollout_cls = ray.remote(TrainerWorker), ray.remote(RolloutWorker)
    trainers: list[Any] = [
        trainer_cls.options(**where.options("trainer", r)).remote(r, n, init_method, cfg_data, model, device, threads)
        for r in range(n)
    ]
    rollouts: list[Any] = [
        rollout_cls.options(**where.options("rollout", i)).remote(cfg_data, model, device, threads)
        for i in range(rc.rollout_workers)
    ]
    try:
        calls.get([t.ready.remote() for t in trainers], _names_of("trainer", n))
        calls.get([r.pid.remote() for r in rollouts], _names_of("rollout", rc.rollout_workers))
    except WorkerDied as e:  # a constructor raised: not a fault to resume from
        for actor in trainers + rollouts:
            ray.kill(actor, no_restart=True)
        remove_placement_group(where.group)
        raise WorkerError(f"workers failed to start: {e}") from e
    return trainers, rollouts


def _names_of(role: str, count: int) -> list[str]:
    return [f"{role}-{i}" for i in range(count)]


def create_ray_parts(cfg: RunConfig, model_dir: str | Path, log: Callable[[str], None] = print) -> RayParts:
    """Place the actors, set up the trainers' process group, and check the engines start in sync."""
    rc = cfg.ray or RayConfig()
    calls = _Calls(rc.actor_timeout_s)
    where = _place(rc, calls)
    if rc.sync == "ipc" and not where.use_gpu:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(where.group)
        raise UserError(
            "ray.sync 'ipc' shares GPU memory between the trainer and rollout workers (CUDA IPC); this Ray has "
            f"{len(_bundles(rc, True))} GPU bundle(s) to place but not enough GPUs: use 'objectstore' or 'collective'"
        )
    trainers, rollouts = _start_actors(cfg, model_dir, where, calls)
    r_names = _names_of("rollout", rc.rollout_workers)
    fp8_names = calls.get(rollouts[0].fp8_weight_names.remote(), "rollout-0")
    pad = calls.get(rollouts[0].pad_token_id.remote(), "rollout-0")
    bf16_bytes = calls.get(trainers[0].bf16_bytes.remote(), "trainer-0")
    engine = RolloutGroup(rollouts, calls, rc.layout == "colocated", pad, 0, r_names)
    engine.sleep()
    trainer = TrainerGroup(trainers, calls, _names_of("trainer", rc.trainer_workers), rc.trainer_sharding == "fsdp")
    layout = _init_collective_sync(calls, trainer, rollouts, rc, fp8_names) if rc.sync == "collective" else None
    mem = calls.get(trainers[0].memory.remote(), "trainer-0.memory")
    held_mb = (mem["param_bytes"] + mem["master_bytes"] + mem["optimizer_state_bytes"]) / 2**20
    log(
        f"ray: {rc.trainer_workers} trainer worker(s), {rc.rollout_workers} rollout worker(s), layout {rc.layout}, "
        f"device {where.device}, sync {rc.sync}, trainer sharding {rc.trainer_sharding} "
        f"(rank 0 holds {held_mb:.1f} MB of weights, fp32 masters and AdamW state)"
    )
    return RayParts(
        load_tokenizer(model_dir), bf16_bytes, engine, trainer, str(model_dir), cfg.verify_sync, where.group,
        fp8_names, layout, cfg.recipe.kv_cache, rc.sync == "ipc",
    )  # fmt: skip


def _init_collective_sync(
    calls: _Calls, trainer: TrainerGroup, receivers: list[Any], rc: RayConfig, fp8_names: list[str]
) -> Any:
    """Form the sync group (trainer rank 0 + every rollout worker) and agree on the payload layout."""
    sender = trainer.actors[0]
    address = calls.get(sender.free_address.remote(), "trainer-0.free_address")
    init_method = "tcp://{}:{}".format(*address)
    world = 1 + len(receivers)
    joins = [sender.init_sync_group.remote(init_method, world, fp8_names, rc.sync_bucket_mb)]
    joins += [r.init_sync_group.remote(init_method, i + 1, world) for i, r in enumerate(receivers)]
    calls.get(joins, "sync group")
    return trainer.lead("sync_layout")


def ensure_ray(rc: RayConfig, num_actors: int) -> bool:
    """Connect to the configured Ray, or start a local one; True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    address = rc.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=max(os.cpu_count() or 1, num_actors + 1),
        object_store_memory=rc.object_store_mb * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=True,
    )
    return True


def run_rl_on_ray(
    cfg: RunConfig,
    model_dir: str | Path,
    sink: MetricsSink,
    log: Callable[[str], None] = print,
    output_dir: str | Path | None = None,
    checkpoint_dir: str | Path | None = None,
) -> RLResult:
    """``fp8rl.loop.run_rl`` on Ray actors (module docstring), replacing dead actors from checkpoints."""
    rc = cfg.ray or RayConfig()
    started = ensure_ray(rc, rc.trainer_workers + rc.rollout_workers)
    where = "started a local Ray" if started else "using the running Ray"
    log(
        f"[{cfg.recipe.name}] {where}: {rc.trainer_workers} trainer and {rc.rollout_workers} rollout worker(s), {rc.layout} layout"
    )
    can_resume = checkpoint_dir is not None and cfg.checkpoint_every > 0
    restarts = 0
    try:
        while True:
            parts = create_ray_parts(cfg, model_dir, log)
            try:
                return run_rl(
                    cfg, model_dir, sink, log=log, output_dir=output_dir, parts=parts, checkpoint_dir=checkpoint_dir
                )
            except WorkerDied as e:
                if not can_resume or restarts >= rc.max_restarts:
                    raise
                restarts += 1
                log(f"{e}; replacing the workers and resuming from the last checkpoint ({restarts}/{rc.max_restarts})")
            finally:
                parts.shutdown()
    finally:
        if started:
            import ray

            ray.shutdown()
