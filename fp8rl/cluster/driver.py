"""The RL step on Ray: the one-process loop (``fp8rl.loop.run_rl``) driving Ray actors.

``run_rl_on_ray`` places ``trainer_workers`` data-parallel trainer actors and
``rollout_workers`` rollout actors (``fp8rl.cluster.workers``) in one placement group and
hands ``run_rl`` a ``RayParts`` whose engine and trainer forward to them (``fp8rl.cluster.groups``), so the
loop computes what it computes in one process.  Placement (``fp8rl.cluster.placement``), by layout:

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from fp8rl.cluster.groups import ActorCalls, RolloutGroup, TrainerGroup, WorkerDied
from fp8rl.cluster.memory import merge_peaks
from fp8rl.cluster.placement import bundles, names_of, place, start_actors
from fp8rl.config import RayConfig, RunConfig, kv_scales_calibrated
from fp8rl.errors import UserError
from fp8rl.fp8_coverage import fp8_linear_counts
from fp8rl.loop import RLResult, run_rl
from fp8rl.models.loading import load_tokenizer
from fp8rl.quant.launch_config import LAUNCH_ENV
from fp8rl.rollout.kv_calibration import kv_scale_metrics
from fp8rl.sync import PolicySync, SyncStats, transport
from fp8rl.tracking import MetricsSink
from fp8rl.train.trainer import SequenceBatch


@dataclass
class RayParts:
    """``fp8rl.loop.Parts`` on Ray actors; the weight sync is the driver's push of the transport ``ray.sync`` names
    (``fp8rl.sync.transport``)."""

    tok: PreTrainedTokenizerBase
    bf16_bytes: int
    engine: RolloutGroup
    trainer: TrainerGroup
    model_dir: str
    placement_group: Any
    sync: PolicySync
    calibrate_kv_scales: bool = False  # config.kv_scales_calibrated: calibrate_kv recalibrates the engines' scales
    sleep_after_sync: bool = True  # RayConfig.sleep_after_sync: False keeps colocated engines awake until generation
    fp8_linears: dict[str, int] = field(default_factory=dict)  # fp8rl.fp8_coverage.fp8_linear_counts

    def calibrate_kv(self, batch: SequenceBatch) -> dict[str, float]:
        """FP8 KV cache: scales from trainer rank 0's policy (every rank's forward when sharded), written into
        every engine; ``kv/...`` metrics.  ``{}`` for a bf16 KV cache or one vLLM scales per token and head."""
        if not self.calibrate_kv_scales:
            return {}
        scales, seconds = self.trainer.kv_scales(batch)
        self.engine.wake_up()
        self.engine.calls.get([a.set_kv_scales.remote(scales) for a in self.engine.actors], self.engine.names)
        self.after_sync()
        return kv_scale_metrics(scales, seconds)

    def after_sync(self) -> None:
        """The engines go back to sleep after a load, unless they are to stay awake until the next generation."""
        if self.sleep_after_sync:
            self.engine.sleep()

    def push_weights(self, version: int) -> SyncStats:
        return self.sync.push(version)

    def save_policy(self, output_dir: str | Path) -> None:
        self.trainer.save_policy(str(output_dir), self.model_dir)

    def gpu_peaks(self, reset: bool = False) -> dict[str, int]:
        """Peak bytes in use per GPU since the start or the last reset, keyed by the actors on it
        (``trainer-0+rollout-0`` colocated; the whole GPU, as nvidia-smi counts it); ``{}`` on CPUs."""
        actors = self.trainer.actors + self.engine.actors
        names = [*self.trainer.names, *self.engine.names]
        reports = self.trainer.calls.get([a.gpu_peak.remote(reset) for a in actors], [f"{n}.gpu_peak" for n in names])
        return merge_peaks(reports, names)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.trainer.actors + self.engine.actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.placement_group)


def create_ray_parts(cfg: RunConfig, model_dir: str | Path, log: Callable[[str], None] = print) -> RayParts:
    """Place the actors, set up the trainers' process group, and check the engines start in sync."""
    rc = cfg.ray or RayConfig()
    calls = ActorCalls(rc.actor_timeout_s)
    where = place(rc, calls)
    if rc.sync == "ipc" and not where.use_gpu:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(where.group)
        raise UserError(
            "ray.sync 'ipc' shares GPU memory between the trainer and rollout workers (CUDA IPC); this Ray has "
            f"{len(bundles(rc, True))} GPU bundle(s) to place but not enough GPUs: use 'objectstore' or 'collective'"
        )
    trainers, rollouts = start_actors(cfg, model_dir, where, calls)
    r_names = names_of("rollout", rc.rollout_workers)
    fp8_names = calls.get(rollouts[0].fp8_weight_names.remote(), "rollout-0")
    pad = calls.get(rollouts[0].pad_token_id.remote(), "rollout-0")
    bf16_bytes = calls.get(trainers[0].bf16_bytes.remote(), "trainer-0")
    trainer_fp8 = calls.get(trainers[0].fp8_module_count.remote(), "trainer-0")
    fp8_linears = fp8_linear_counts(cfg.recipe, len(fp8_names), trainer_fp8)
    engine = RolloutGroup(
        rollouts, calls, rc.layout == "colocated", pad, 0, r_names, tp=cfg.rollout.tensor_parallel_size
    )
    engine.sleep()
    trainer = TrainerGroup(trainers, calls, names_of("trainer", rc.trainer_workers), rc.trainer_sharding == "fsdp")
    if not rc.sleep_after_sync:  # the trainer state's gather (a checkpoint) runs with the engines asleep
        trainer.before_full_state = engine.sleep
    mem = calls.get(trainers[0].memory.remote(), "trainer-0.memory")
    held_mb = (mem["param_bytes"] + mem["master_bytes"] + mem["optimizer_state_bytes"]) / 2**20
    where_state = ", AdamW state in host memory between steps" if mem["optimizer_state_offloaded"] else ""
    log(
        f"ray: {rc.trainer_workers} trainer worker(s), {rc.rollout_workers} rollout worker(s), layout {rc.layout}, "
        f"device {where.device}, sync {rc.sync}, trainer sharding {rc.trainer_sharding}"
        f"{f', rollout tensor parallel {tp}' if (tp := cfg.rollout.tensor_parallel_size) > 1 else ''} "
        f"(rank 0 holds {held_mb:.1f} MB of weights, fp32 masters and AdamW state{where_state})"
    )
    after_sync = engine.sleep if rc.sleep_after_sync else (lambda: None)
    return RayParts(
        load_tokenizer(model_dir), bf16_bytes, engine, trainer, str(model_dir), where.group,
        transport(rc.sync).policy_sync(rc, engine, trainer, fp8_names, cfg.verify_sync, after_sync),
        calibrate_kv_scales=kv_scales_calibrated(cfg.recipe, cfg.rollout), sleep_after_sync=rc.sleep_after_sync,
        fp8_linears=fp8_linears,
    )  # fmt: skip


def ensure_ray(rc: RayConfig, num_actors: int) -> bool:
    """Connect to the configured Ray, or start a local one; True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    address = rc.address or os.environ.get("RAY_ADDRESS")
    if address:
        # a remote cluster's workers do not inherit this process's environment: pass on what fp8rl reads from it
        env = {k: os.environ[k] for k in (LAUNCH_ENV,) if os.environ.get(k)}
        ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": env} if env else None)
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=max(os.cpu_count() or 1, num_actors + 1),
        object_store_memory=rc.object_store_mb * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=True,
    )
    return True


def stop_ray() -> None:
    """Shut down the Ray this process started (``ensure_ray`` returned True)."""
    import ray

    ray.shutdown()


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
    import ray

    from fp8rl.provenance import gpu_tags

    sink.set_tags(gpu_tags(ray.cluster_resources()))  # the GPUs the actors run on, not the driver's
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
            stop_ray()
