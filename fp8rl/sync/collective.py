"""``ray.sync: collective``: trainer rank 0 broadcasts the requantized payload into every rollout worker's engine.

Trainer rank 0 and the rollout workers form a process group of their own (NCCL on GPUs, gloo on CPUs), beside the
trainers' data-parallel group, and agree once on the payload's layout; each push then travels in buckets
(``fp8rl.sync.broadcast``) straight into the engines, in place.  Here are rank 0's sender, the rollout worker's
receiver and the driver's push.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from fp8rl.quant import QuantSpec
from fp8rl.rollout.base import LocalEngine
from fp8rl.sync.base import (
    ActorSync,
    Engines,
    FullWeights,
    SyncStats,
    Trainers,
    payload_bytes,
    requantize_for_rollout,
)
from fp8rl.sync.broadcast import (
    DEFAULT_BUCKET_BYTES,
    SyncGroup,
    broadcast_payload,
    new_sync_group,
    receive_into,
    synchronize,
)
from fp8rl.sync.buckets import SyncLayout, layout_of

if TYPE_CHECKING:
    from fp8rl.config import RayConfig
    from fp8rl.config.run import SyncTransport

# the sync group's gloo/NCCL collectives give up after this long rather than hang on a dead peer
SYNC_TIMEOUT_S = 300


def join_sync_group(init_method: str, rank: int, world_size: int, device: torch.device) -> SyncGroup:
    """The weight-sync process group (trainer rank 0 sends, rollout workers receive), beside the data-parallel one."""
    backend: Literal["nccl", "gloo"] = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)  # NCCL ranks need their device set before the first push
    return new_sync_group(init_method, rank, world_size, backend, SYNC_TIMEOUT_S)


class CollectiveSender:
    """Trainer rank 0: requantize once, broadcast to the rollout workers.

    Each rollout worker meanwhile calls ``receive_into(engine, layout, version, ...)`` on the
    same group; ``layout(weights)`` gives the layout to hand them once, before the first push.
    """

    def __init__(
        self,
        fp8_weight_names: set[str],
        spec: QuantSpec,
        *,
        device: torch.device | str,
        group: SyncGroup | None = None,
        src: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        verify: bool = False,
    ) -> None:
        self.fp8_weight_names = fp8_weight_names
        self.spec = spec
        self.device = torch.device(device)
        self.group = group
        self.src = src
        self.bucket_bytes = bucket_bytes
        self.verify = verify
        # names and shapes are fixed for a run: the layout (and its fingerprint) is derived once, and
        # every later push is checked against it
        self._layout: SyncLayout | None = None

    def layout(self, weights: Mapping[str, torch.Tensor]) -> SyncLayout:
        """The layout every push of weights with these names and shapes has (requantizes once)."""
        self._layout = layout_of(requantize_for_rollout(weights, self.fp8_weight_names, self.spec))
        return self._layout

    def broadcast(self, weights: Mapping[str, torch.Tensor], version: int) -> SyncStats:
        t0 = time.perf_counter()
        payload = requantize_for_rollout(weights, self.fp8_weight_names, self.spec)
        synchronize(self.device)
        t1 = time.perf_counter()
        if self._layout is None:
            self._layout = layout_of(payload)
        broadcast_payload(
            payload,
            self._layout,
            self.src,
            self.group,
            self.device,
            self.bucket_bytes,
            verify=self.verify,
            version=version,
        )
        t2 = time.perf_counter()
        return SyncStats(version, payload_bytes(payload), len(payload), t1 - t0, t2 - t1, self.verify)

    def send(self, full_weights: FullWeights, version: int) -> tuple[int, float, float] | None:
        """Broadcast the requantized weights (rank 0); (bytes, requantize s, transfer s)."""
        weights = full_weights(1)
        if weights is None:
            return None
        stats = self.broadcast(weights, version)
        return stats.bytes_sent, stats.requantize_seconds, stats.load_seconds

    def done(self) -> None:
        pass


def sender(
    fp8_names: list[str],
    spec: QuantSpec,
    device: torch.device,
    verify: bool,
    full_weights: FullWeights,
    rendezvous: tuple[str, int] | None = None,
    bucket_mb: int = 0,
) -> tuple[CollectiveSender, SyncLayout | None]:
    """A trainer rank's sender: rank 0 (``rendezvous``: init method and world size) joins the sync group as its
    rank 0; every rank takes part in agreeing on the layout (sharded, the gather); rank 0 returns it."""
    group = None
    if rendezvous is not None:
        group = join_sync_group(rendezvous[0], 0, rendezvous[1], device)
    built = CollectiveSender(
        set(fp8_names), spec, device=device, group=group, src=0, bucket_bytes=bucket_mb << 20, verify=verify
    )
    weights = full_weights(1)
    return built, None if weights is None else built.layout(weights)


class CollectiveReceiver:
    """Rollout worker: a receiver (rank >= 1) of the sync group; whether to verify is the sender's choice."""

    def __init__(self, engine: LocalEngine, init_method: str, rank: int, world_size: int) -> None:
        self.engine = engine
        self.group = join_sync_group(init_method, rank, world_size, engine.device)

    def receive(self, message: SyncLayout, version: int) -> int:
        """Receive one broadcast push into the engine in place; the sender decides whether to verify."""
        stats = receive_into(self.engine, message, version, device=self.engine.device, group=self.group, src=0)
        return stats.bytes_sent


def receiver(engine: LocalEngine, verify: bool, init_method: str, rank: int, world_size: int) -> CollectiveReceiver:
    """A rollout worker's receiver; joins the sync group as ``rank`` (the sender verifies, or not)."""
    return CollectiveReceiver(engine, init_method, rank, world_size)


@dataclass
class CollectiveSync(ActorSync):
    """The driver's push: rank 0 broadcasts while every rollout worker receives."""

    transport: ClassVar[SyncTransport] = "collective"
    layout: Any = None  # SyncLayout: what the broadcast carries, agreed once (connect)

    def connect(self, rc: RayConfig) -> Any:
        """Form the sync group (trainer rank 0 + every rollout worker) and agree on the payload layout."""
        trainer, engine = self.trainer, self.engine
        address = trainer.calls.get(trainer.actors[0].free_address.remote(), f"{trainer.names[0]}.free_address")
        init_method, world = "tcp://{}:{}".format(*address), 1 + len(engine.actors)
        lead = {"rendezvous": (init_method, world), "bucket_mb": rc.sync_bucket_mb}
        senders = [lead] + [{}] * (len(trainer.actors) - 1)
        receivers = [{"init_method": init_method, "rank": i + 1, "world_size": world} for i in range(world - 1)]
        self.layout = self.connect_workers(senders, receivers)
        return self.layout

    def push(self, version: int) -> SyncStats:
        engine = self.engine
        engine.wake_up()
        sends = [a.send_weights.remote(version) for a in self._senders(1)]
        receives = [a.receive_weights.remote(self.layout, version) for a in engine.actors]
        t_names = [f"{n}.send_weights" for n in self.trainer.names[: len(sends)]]
        sent, *_rest = engine.calls.get([*sends, *receives], [*t_names, *engine.names])
        self._loaded(version)
        nbytes, requant_s, transfer_s = sent
        return SyncStats(version, int(nbytes), len(self.fp8_names), requant_s, transfer_s, self.verify)


def policy_sync(
    rc: RayConfig,
    engine: Engines,
    trainer: Trainers,
    fp8_names: list[str],
    verify: bool,
    after_sync: Callable[[], None],
) -> CollectiveSync:
    """The driver's push, its sync group formed and the layout agreed."""
    sync = CollectiveSync(engine, trainer, fp8_names, verify, after_sync)
    sync.connect(rc)
    return sync
