"""The Ray weight sync: the trainer's weights, requantized with the rollout recipe, into every rollout worker's engine.

One class per ``ray.sync`` transport, chosen once when the parts are built (``transport_for``); each implements
``fp8rl.sync.PolicySync`` (``push(version) -> SyncStats``), as the one-process sync does:

- ``objectstore``: requantized once on trainer rank 0 (sharded: every rank joins the gather of the weights); the
  payload stays in Ray's object store and each rollout worker fetches it by reference;
- ``collective``: trainer rank 0 broadcasts in buckets over a process group with every rollout worker, which
  receives into its engine in place (the layout agreed once, ``init_collective``);
- ``ipc``: trainer rank i packs its payload into a device buffer; rollout worker i, on the same GPU, maps it through
  CUDA IPC and loads from it; then the buffers are freed.

After a load the engines sleep again unless told to stay awake until the next generation (``after_sync``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fp8rl.cluster.groups import ActorCalls, RolloutGroup, TrainerGroup
from fp8rl.config import RayConfig
from fp8rl.sync import PolicySync, SyncStats


@dataclass
class _RaySync:
    engine: RolloutGroup
    trainer: TrainerGroup
    fp8_names: list[str]
    verify: bool
    after_sync: Callable[[], None]

    def _senders(self, limit: int | None = None) -> list[Any]:
        """The trainer ranks that send: all of them when sharded (each joins the gather), else the first ``limit``."""
        return self.trainer.actors if self.trainer.sharded else self.trainer.actors[:limit]

    def _loaded(self, version: int) -> None:
        self.after_sync()
        self.engine.policy_version = version


class ObjectStoreSync(_RaySync):
    def push(self, version: int) -> SyncStats:
        t0 = time.perf_counter()
        payload_refs = [a.rollout_payload.remote(self.fp8_names) for a in self._senders(1)]
        self.engine.wake_up()
        loads = [a.load_weights.remote(payload_refs[0], version, self.verify) for a in self.engine.actors]
        sizes = self.engine.calls.get(loads, [f"{n}.load_weights" for n in self.engine.names])
        self.trainer.calls.get(payload_refs[1:], [f"{n}.rollout_payload" for n in self.trainer.names[1:]])
        self._loaded(version)
        seconds = time.perf_counter() - t0
        return SyncStats(version, int(sizes[0]), len(self.fp8_names), 0.0, seconds, self.verify)


@dataclass
class CollectiveSync(_RaySync):
    layout: Any = None  # fp8rl.sync.SyncLayout: what the broadcast carries, agreed once (init_collective)

    def push(self, version: int) -> SyncStats:
        engine = self.engine
        engine.wake_up()
        sends = [a.push_weights.remote(version) for a in self._senders(1)]
        receives = [a.receive_weights.remote(self.layout, version) for a in engine.actors]
        t_names = [f"{n}.push_weights" for n in self.trainer.names[: len(sends)]]
        sent, *_rest = engine.calls.get([*sends, *receives], [*t_names, *engine.names])
        self._loaded(version)
        nbytes, requant_s, transfer_s = sent
        return SyncStats(version, int(nbytes), len(self.fp8_names), requant_s, transfer_s, self.verify)


class IpcSync(_RaySync):
    def push(self, version: int) -> SyncStats:
        engine, trainer = self.engine, self.trainer
        senders = self._senders(len(engine.actors))
        names = trainer.names[: len(senders)]
        shared = trainer.calls.get([a.share_rollout_payload.remote(self.fp8_names) for a in senders],
                                   [f"{n}.share_rollout_payload" for n in names])  # fmt: skip
        try:
            engine.wake_up()
            loads = [a.load_shared.remote(shared[i][0], version, self.verify) for i, a in enumerate(engine.actors)]
            loaded = engine.calls.get(loads, [f"{n}.load_shared" for n in engine.names])
        finally:
            trainer.calls.get([a.release_shared.remote() for a in senders], [f"{n}.release_shared" for n in names])
        self._loaded(version)
        requant_s = max(s[1] for s in shared if s is not None)
        return SyncStats(
            version, int(loaded[0][0]), len(self.fp8_names), requant_s, max(b[1] for b in loaded), self.verify
        )


def init_collective(
    calls: ActorCalls, trainer: TrainerGroup, receivers: list[Any], rc: RayConfig, fp8_names: list[str]
) -> Any:
    """Form the sync group (trainer rank 0 + every rollout worker) and agree on the payload layout."""
    sender = trainer.actors[0]
    address = calls.get(sender.free_address.remote(), "trainer-0.free_address")
    init_method = "tcp://{}:{}".format(*address)
    world = 1 + len(receivers)
    joins = [sender.init_sync_group.remote(init_method, world, fp8_names, rc.sync_bucket_mb)]
    joins += [r.init_sync_group.remote(init_method, i + 1, world) for i, r in enumerate(receivers)]
    calls.get(joins, "sync group")
    return trainer.sync_layout()


def transport_for(
    rc: RayConfig, engine: RolloutGroup, trainer: TrainerGroup, fp8_names: list[str], verify: bool,
    after_sync: Callable[[], None],
) -> PolicySync:  # fmt: skip
    """The transport ``rc.sync`` names (the collective one forms its group here)."""
    common = (engine, trainer, fp8_names, verify, after_sync)
    if rc.sync == "collective":
        return CollectiveSync(*common, init_collective(engine.calls, trainer, engine.actors, rc, fp8_names))
    if rc.sync == "ipc":
        return IpcSync(*common)
    return ObjectStoreSync(*common)
