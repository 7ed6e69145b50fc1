"""Where the actors of one RL step run: one placement group (a bundle per actor, or per trainer/rollout pair in
the colocated layout; a GPU each where the cluster has them) and the actors started in it."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8rl.cluster.groups import ActorCalls, WorkerDied, WorkerError
from fp8rl.config import RayConfig, RunConfig

CPUS_PER_BUNDLE = 1.0


def bundles(rc: RayConfig, use_gpu: bool) -> list[dict[str, float]]:
    count = (
        max(rc.trainer_workers, rc.rollout_workers)
        if rc.layout == "colocated"
        else rc.trainer_workers + rc.rollout_workers
    )
    bundle = {"CPU": CPUS_PER_BUNDLE, **({"GPU": 1.0} if use_gpu else {})}
    return [dict(bundle) for _ in range(count)]


def bundle_index(rc: RayConfig, role: str, i: int) -> int:
    if rc.layout == "colocated":
        return i % max(rc.trainer_workers, rc.rollout_workers)
    return i if role == "trainer" else rc.trainer_workers + i


@dataclass
class Placement:
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
        index = bundle_index(self.rc, role, i)
        opts: dict[str, Any] = {
            "num_cpus": CPUS_PER_BUNDLE * share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index),
        }
        if actor:
            opts |= {"num_gpus": share if self.use_gpu else 0, "name": f"{self.prefix}{role}-{i}", "max_restarts": 0}
        return opts


def place(rc: RayConfig, calls: ActorCalls) -> Placement:
    import ray
    from ray.util.placement_group import placement_group

    use_gpu = ray.cluster_resources().get("GPU", 0) >= len(bundles(rc, True))
    group = placement_group(bundles(rc, use_gpu), strategy="PACK")
    calls.get(group.ready(), "placement group (are enough CPUs/GPUs free?)")
    return Placement(rc, group, use_gpu, f"fp8rl-{uuid.uuid4().hex[:8]}-")


def start_actors(
    cfg: RunConfig, model_dir: str | Path, where: Placement, calls: ActorCalls
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
    trainers_ready = [t.ready.remote() for t in trainers]
    rollouts: list[Any] = []
    try:
        if rc.layout == "colocated" and where.use_gpu:
            # vLLM sizes its KV cache from the free memory it measures while it starts: the trainers on its
            # GPU have placed their weights first, so that measure does not move under it
            calls.get(trainers_ready, names_of("trainer", n))
        # tensor parallelism: workers tp*g .. tp*g+tp-1 are one engine, meeting at an address on its first worker's node
        tp = cfg.rollout.tensor_parallel_size
        meet = [
            calls.get(ray.remote(node_address).options(**where.options("rollout", g * tp, actor=False)).remote(),
                      f"rollout-{g * tp} address") if tp > 1 else None
            for g in range(rc.rollout_workers // tp)
        ]  # fmt: skip
        rollouts = [
            rollout_cls.options(**where.options("rollout", i)).remote(
                cfg_data, model, device, threads, i % tp, meet[i // tp]
            )
            for i in range(rc.rollout_workers)
        ]
        calls.get(trainers_ready, names_of("trainer", n))
        calls.get([r.pid.remote() for r in rollouts], names_of("rollout", rc.rollout_workers))
    except WorkerDied as e:  # a constructor raised: not a fault to resume from
        for actor in trainers + rollouts:
            ray.kill(actor, no_restart=True)
        remove_placement_group(where.group)
        raise WorkerError(f"workers failed to start: {e}") from e
    return trainers, rollouts


def names_of(role: str, count: int) -> list[str]:
    return [f"{role}-{i}" for i in range(count)]
