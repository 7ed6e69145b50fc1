"""``ray.sync: ipc``: weight sync between two processes on one GPU through CUDA IPC: no host copy, no collective.

In the colocated layout a trainer rank and a rollout worker share a GPU.  The object-store path
copies the requantized policy to host memory, through Ray's shared memory and back; a collective
cannot join two ranks on one device.  Here the sender packs the payload into one device buffer
(the bucket layout of ``fp8rl.sync.buckets``, a single bucket), and hands the receiver a CUDA IPC
handle of it (``torch.multiprocessing``'s reduction of a CUDA tensor: a few hundred bytes that
pickle through Ray).  The receiver maps the same device memory, loads the engine from views of it
(one device-to-device copy per tensor), and drops the mapping; then the sender frees the buffer.

Device identity: the handle names the sender's device index under its ``CUDA_VISIBLE_DEVICES``;
the receiver finds the device with the same UUID among its own (Ray may number them differently)
and refuses when it has none: IPC only works within one GPU's memory.  The sender keeps the buffer
until ``release`` (torch also keeps a shared block alive while a receiver still maps it).

Trainer rank i sends for rollout worker i (replicated, each rank its own identical weights; sharded, every rank joins
the gather and ranks 0 .. rollout_workers-1 keep the full weights): ``IpcSender``, ``IpcReceiver`` and the driver's
``IpcSync``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from fp8rl.quant import QuantizedTensor, QuantSpec
from fp8rl.rollout.base import RolloutEngine
from fp8rl.sync.base import (
    ActorSync,
    Engines,
    FullWeights,
    Payload,
    SyncStats,
    Trainers,
    payload_bytes,
    requantize_for_rollout,
    verify_engine_weights,
)
from fp8rl.sync.buckets import Bucket, SyncLayout, layout_of, pack_bucket, plan_buckets, unpack_bucket

if TYPE_CHECKING:
    from fp8rl.config import RayConfig
    from fp8rl.config.run import SyncTransport

# torch's rebuild arguments of a CUDA tensor (torch.multiprocessing.reductions.reduce_tensor): the
# storage's device index sits at this position; checked against the sender's index before it is replaced
_DEVICE_ARG = 6


class IpcUnavailableError(RuntimeError):
    """The payload cannot cross by CUDA IPC (CPU tensors, or sender and receiver on different GPUs)."""


@dataclass(frozen=True)
class SharedPayload:
    """What a receiver needs to map a packed payload: small and picklable."""

    layout: SyncLayout
    bucket: Bucket
    device_uuid: str
    rebuild: Any  # torch's rebuild function and its arguments, as reduce_tensor gives them
    args: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        return self.bucket.nbytes


def device_uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def share_payload(payload: Payload) -> tuple[SharedPayload, torch.Tensor]:
    """Pack ``payload`` (every tensor on one CUDA device) into one buffer and share it.

    Returns the handle and the buffer; the caller keeps the buffer alive until every receiver has
    loaded from it (then drops it and calls ``release``)."""
    if not payload:
        raise ValueError("share_payload: the payload is empty")
    devices = {(v.data if isinstance(v, QuantizedTensor) else v).device for v in payload.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        got = sorted(map(str, devices))
        raise IpcUnavailableError(f"CUDA IPC sync needs the whole payload on one CUDA device, got {got}")
    device = next(iter(devices))
    layout = layout_of(payload)
    bucket = plan_buckets(layout, sum(e.packed_nbytes for e in layout.entries))[0]
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    pack_bucket(payload, bucket, buffer)
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(buffer)  # records an event the receiver waits on: the pack is complete first
    index = device.index if device.index is not None else torch.cuda.current_device()
    if args[_DEVICE_ARG] != index:
        raise IpcUnavailableError(
            f"torch's CUDA tensor reduction changed its layout (argument {_DEVICE_ARG} is {args[_DEVICE_ARG]!r}, "
            f"not the device index {index}); fp8rl.sync.ipc needs updating for this torch"
        )
    return SharedPayload(layout, bucket, device_uuid(index), rebuild, tuple(args)), buffer


def local_device(uuid: str) -> int:
    """This process's index of the CUDA device with ``uuid``."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise IpcUnavailableError(
        f"the sender's GPU {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); CUDA IPC sync needs the trainer rank and the "
        "rollout worker on the same GPU (ray.layout colocated)"
    )


def open_payload(shared: SharedPayload) -> tuple[Payload, torch.Tensor]:
    """Map the sender's buffer; returns the payload as views of it and the mapped buffer.

    Drop both once the engine has copied from them: that unmaps the memory for the sender."""
    args = list(shared.args)
    args[_DEVICE_ARG] = local_device(shared.device_uuid)
    buffer = shared.rebuild(*args)
    return unpack_bucket(buffer, shared.bucket), buffer


def release() -> None:
    """Let the caching allocator reuse blocks that were shared and are no longer mapped anywhere."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()


class IpcSender:
    """Trainer rank: the requantized payload packed into one device buffer this rank keeps until ``done``."""

    def __init__(self, fp8_names: list[str], spec: QuantSpec, answering: int) -> None:
        self.fp8_names = set(fp8_names)
        self.spec = spec
        self.answering = answering  # ranks 0 .. answering-1 have a rollout worker on their GPU
        self._buffer: torch.Tensor | None = None

    def send(self, full_weights: FullWeights, version: int) -> tuple[SharedPayload, float] | None:
        """(the buffer's handle, seconds to gather, requantize and pack); None on a rank that does not answer."""
        self.done()
        t0 = time.perf_counter()
        weights = full_weights(self.answering)
        if weights is None:
            return None
        payload = requantize_for_rollout(weights, self.fp8_names, self.spec)
        shared, buffer = share_payload(payload)
        del payload, weights
        torch.cuda.synchronize(buffer.device)  # the seconds returned include the pack
        self._buffer = buffer
        # colocated: the engine wakes up next; the blocks the caching allocator holds but no tensor uses
        # (activations, gathered weights) go back to the driver so vLLM can take them
        torch.cuda.empty_cache()
        return shared, time.perf_counter() - t0

    def done(self) -> None:
        """Drop the buffer the last ``send`` shared (its receivers are done with it)."""
        self._buffer = None
        release()


def sender(
    fp8_names: list[str], spec: QuantSpec, device: torch.device, verify: bool, full_weights: FullWeights,
    answering: int = 1,
) -> tuple[IpcSender, None]:  # fmt: skip
    return IpcSender(fp8_names, spec, answering), None


class IpcReceiver:
    """Rollout worker: load from the trainer's shared buffer in place, then unmap it; (bytes, seconds)."""

    def __init__(self, engine: RolloutEngine, verify: bool) -> None:
        self.engine = engine
        self.verify = verify

    def receive(self, message: SharedPayload, version: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        payload, buffer = open_payload(message)
        try:
            self.engine.load_weights(payload, version)
            if self.verify:
                verify_engine_weights(self.engine, payload, version)
            nbytes = payload_bytes(payload)
            torch.cuda.synchronize(buffer.device)  # every copy out of the sender's memory has finished
        finally:
            del payload, buffer
        return nbytes, time.perf_counter() - t0


def receiver(engine: RolloutEngine, verify: bool) -> IpcReceiver:
    return IpcReceiver(engine, verify)


class IpcSync(ActorSync):
    """The driver's push: rollout worker i loads from trainer rank i's shared buffer; then the buffers are freed."""

    transport: ClassVar[SyncTransport] = "ipc"

    def push(self, version: int) -> SyncStats:
        engine, trainer = self.engine, self.trainer
        senders = self._senders(len(engine.actors))
        names = trainer.names[: len(senders)]
        shared = trainer.calls.get([a.send_weights.remote(version) for a in senders],
                                   [f"{n}.send_weights" for n in names])  # fmt: skip
        try:
            engine.wake_up()
            loads = [a.receive_weights.remote(shared[i][0], version) for i, a in enumerate(engine.actors)]
            loaded = engine.calls.get(loads, [f"{n}.receive_weights" for n in engine.names])
        finally:
            trainer.calls.get([a.sync_done.remote() for a in senders], [f"{n}.sync_done" for n in names])
        self._loaded(version)
        requant_s = max(s[1] for s in shared if s is not None)
        return SyncStats(
            version, int(loaded[0][0]), len(self.fp8_names), requant_s, max(b[1] for b in loaded), self.verify
        )


def policy_sync(
    rc: RayConfig,
    engine: Engines,
    trainer: Trainers,
    fp8_names: list[str],
    verify: bool,
    after_sync: Callable[[], None],
) -> IpcSync:
    """The driver's push, every trainer rank's sender (answering for the rollout worker on its GPU) built."""
    sync = IpcSync(engine, trainer, fp8_names, verify, after_sync)
    sync.connect_workers([{"answering": rc.rollout_workers}] * len(trainer.actors), [{}] * len(engine.actors))
    return sync


__all__ = [
    "IpcReceiver",
    "IpcSender",
    "IpcSync",
    "IpcUnavailableError",
    "SharedPayload",
    "device_uuid",
    "local_device",
    "open_payload",
    "policy_sync",
    "receiver",
    "release",
    "sender",
    "share_payload",
]
