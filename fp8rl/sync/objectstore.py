"""``ray.sync: objectstore``: the requantized payload through Ray's object store.

Trainer rank 0 requantizes once (sharded: every rank joins the gather of the weights) and returns the payload; the
driver hands its reference to every rollout worker, which fetches it, loads it in place and can verify it holds
exactly that payload.

Wire format.  Serializers that go through numpy (Ray's object store) cannot carry ``float8_e4m3fn`` tensors, so the
FP8 values of a ``QuantizedTensor`` travel as their bytes (a zero-copy ``view(torch.uint8)``) and are viewed back on
arrival: the receiver gets bit-identical values.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

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

if TYPE_CHECKING:
    from fp8rl.config import RayConfig
    from fp8rl.config.run import SyncTransport


@dataclass(frozen=True)
class WireQuantized:
    data_bytes: torch.Tensor  # uint8, the shape of the FP8 tensor
    dtype: str  # e.g. "float8_e4m3fn"
    scale_inv: torch.Tensor
    granularity: str
    fmt: object
    block: tuple[int, int] | None


WirePayload = dict[str, torch.Tensor | WireQuantized]


def to_wire(payload: Payload) -> WirePayload:
    out: WirePayload = {}
    for name, value in payload.items():
        if isinstance(value, QuantizedTensor):
            dtype = str(value.data.dtype).removeprefix("torch.")
            out[name] = WireQuantized(
                value.data.view(torch.uint8), dtype, value.scale_inv, value.granularity, value.fmt, value.block
            )
        else:
            out[name] = value
    return out


def from_wire(wire: WirePayload) -> Payload:
    out: Payload = {}
    for name, value in wire.items():
        if isinstance(value, WireQuantized):
            data = value.data_bytes.view(getattr(torch, value.dtype))
            out[name] = QuantizedTensor(data, value.scale_inv, value.granularity, value.fmt, value.block)  # type: ignore[arg-type]
        else:
            out[name] = value
    return out


class ObjectStoreSender:
    """Trainer rank: the weights requantized with the rollout recipe, as a wire payload, from rank 0."""

    def __init__(self, fp8_names: list[str], spec: QuantSpec) -> None:
        self.fp8_names = set(fp8_names)
        self.spec = spec

    def send(self, full_weights: FullWeights, version: int) -> WirePayload | None:
        weights = full_weights(1)
        if weights is None:
            return None
        return to_wire(requantize_for_rollout(weights, self.fp8_names, self.spec))

    def done(self) -> None:
        pass


def sender(
    fp8_names: list[str], spec: QuantSpec, device: torch.device, verify: bool, full_weights: FullWeights
) -> tuple[ObjectStoreSender, None]:
    return ObjectStoreSender(fp8_names, spec), None


class ObjectStoreReceiver:
    """Rollout worker: load the payload in place as policy ``version``; returns the bytes received."""

    def __init__(self, engine: RolloutEngine, verify: bool) -> None:
        self.engine = engine
        self.verify = verify

    def receive(self, message: WirePayload, version: int) -> int:
        payload = from_wire(message)
        self.engine.load_weights(payload, version)
        if self.verify:
            verify_engine_weights(self.engine, payload, version)
        return payload_bytes(payload)


def receiver(engine: RolloutEngine, verify: bool) -> ObjectStoreReceiver:
    return ObjectStoreReceiver(engine, verify)


class ObjectStoreSync(ActorSync):
    """The driver's push: rank 0's payload by reference into every rollout worker."""

    transport: ClassVar[SyncTransport] = "objectstore"

    def push(self, version: int) -> SyncStats:
        t0 = time.perf_counter()
        payload_refs = [a.send_weights.remote(version) for a in self._senders(1)]
        self.engine.wake_up()
        loads = [a.receive_weights.remote(payload_refs[0], version) for a in self.engine.actors]
        sizes = self.engine.calls.get(loads, [f"{n}.receive_weights" for n in self.engine.names])
        self.trainer.calls.get(payload_refs[1:], [f"{n}.send_weights" for n in self.trainer.names[1:]])
        self._loaded(version)
        seconds = time.perf_counter() - t0
        return SyncStats(version, int(sizes[0]), len(self.fp8_names), 0.0, seconds, self.verify)


def policy_sync(
    rc: RayConfig,
    engine: Engines,
    trainer: Trainers,
    fp8_names: list[str],
    verify: bool,
    after_sync: Callable[[], None],
) -> ObjectStoreSync:
    """The driver's push, every trainer rank's sender and rollout worker's receiver built."""
    sync = ObjectStoreSync(engine, trainer, fp8_names, verify, after_sync)
    sync.connect_workers([{}] * len(trainer.actors), [{}] * len(engine.actors))
    return sync
