"""What every weight sync shares: the ``PolicySync`` interface, the requantized payload and its bit-exact check.

The payload is the trainer's weights requantized ONCE with the rollout recipe (``requantize_for_rollout``: FP8 +
scales for the engine's FP8 linears, bf16 for the rest); a transport moves it into the engine(s) and
``verify_engine_weights`` proves an engine holds exactly it and serves the pushed version.  ``ActorSync`` and the
protocols beside it are the driver's view of the Ray workers, as plain objects (this package imports no Ray).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from fp8rl.quant import QuantizedTensor, QuantSpec, quantize_weight
from fp8rl.quant.quantize import check_scales_finite
from fp8rl.rollout.base import RolloutEngine

if TYPE_CHECKING:
    from fp8rl.config.run import SyncTransport

Payload = dict[str, torch.Tensor | QuantizedTensor]


@dataclass(frozen=True)
class SyncStats:
    version: int
    bytes_sent: int
    tensors: int
    requantize_seconds: float
    load_seconds: float
    verified: bool


class SyncVerificationError(RuntimeError):
    """The engine does not hold exactly what was pushed (or serves the wrong version)."""


class PolicySync(Protocol):
    """The trainer's current weights -> the engine(s), requantized with the rollout recipe, as policy ``version``.

    One implementation per place the engine lives: ``fp8rl.sync.inprocess`` (same process) and one module per
    ``ray.sync`` value (``objectstore``, ``collective``, ``ipc``), each holding the trainer rank's sender, the rollout
    worker's receiver and this push, which the driver calls after every optimizer step."""

    def push(self, version: int) -> SyncStats: ...


# a trainer rank's full weights as a sender asks for them: ``full_weights(answering)`` gives them on ranks
# 0 .. answering-1 and None on the others (sharded, every rank joins the gather; fp8rl.cluster.workers.TrainerWorker)
FullWeights = Callable[[int], "dict[str, torch.Tensor] | None"]


class Sender(Protocol):
    """A trainer rank's side of a Ray transport; ``TrainerWorker.send_weights`` delegates to it.  Returns what the
    driver hands the receivers (or the push's own figures), None on a rank that does not answer."""

    def send(self, full_weights: FullWeights, version: int) -> Any: ...

    def done(self) -> None:
        """The receivers have loaded this push (a sender holding memory for them can free it)."""
        ...


class Receiver(Protocol):
    """A rollout worker's side of a Ray transport; ``RolloutWorker.receive_weights`` delegates to it."""

    def receive(self, message: Any, version: int) -> Any: ...


class Calls(Protocol):
    """A bounded wait on remote calls, naming the worker that failed (``fp8rl.cluster.groups.ActorCalls``)."""

    def get(self, refs: Any, names: str | list[str]) -> Any: ...


class Workers(Protocol):
    """Workers seen from the driver (``fp8rl.cluster.groups``): handles whose methods are called as
    ``handle.method.remote(...)`` (a reference to wait on with ``calls.get``), and their names."""

    actors: list[Any]
    names: list[str]
    calls: Calls


class Engines(Workers, Protocol):
    """The rollout workers: woken up to load (colocated), and the policy version they serve."""

    policy_version: int

    def wake_up(self) -> None: ...


class Trainers(Workers, Protocol):
    """The trainer ranks; sharded (FSDP), every rank takes part in gathering the full weights."""

    sharded: bool


@dataclass
class ActorSync:
    """What the driver's push of every Ray transport holds: the trainer ranks that send (``send_weights``), the
    rollout workers that receive (``receive_weights``), and what to do after a load (``after_sync``: the engines
    sleep again unless told to stay awake until the next generation).  The actors' generic calls delegate to the
    transport's sender and receiver (``fp8rl.cluster.workers``)."""

    transport: ClassVar[SyncTransport]  # the ray.sync value: the module the actors build their sender and receiver from
    engine: Engines
    trainer: Trainers
    fp8_names: list[str]
    verify: bool
    after_sync: Callable[[], None]

    def connect_workers(self, senders: list[dict[str, Any]], receivers: list[dict[str, Any]]) -> Any:
        """Every trainer rank builds its sender (``senders[i]``: its options) and every rollout worker its receiver,
        all at once (a transport with a process group of its own forms it here); returns trainer rank 0's answer."""
        t, e = self.trainer, self.engine
        verify, name = self.verify, self.transport
        sends = [a.init_sender.remote(name, self.fp8_names, verify, o) for a, o in zip(t.actors, senders, strict=True)]
        receives = [a.init_receiver.remote(name, verify, o) for a, o in zip(e.actors, receivers, strict=True)]
        names = [f"{n}.init_sender" for n in t.names] + [f"{n}.init_receiver" for n in e.names]
        return t.calls.get([*sends, *receives], names)[0]

    def _senders(self, limit: int | None = None) -> list[Any]:
        """The trainer ranks that send: all of them when sharded (each joins the gather), else the first ``limit``."""
        return self.trainer.actors if self.trainer.sharded else self.trainer.actors[:limit]

    def _loaded(self, version: int) -> None:
        self.after_sync()
        self.engine.policy_version = version


def requantize_for_rollout(
    weights: Mapping[str, torch.Tensor],
    fp8_weight_names: set[str],
    spec: QuantSpec,
    dtype: torch.dtype = torch.bfloat16,
) -> Payload:
    """FP8 (``QuantizedTensor``) for ``fp8_weight_names``, ``dtype`` copies for everything else.

    On CUDA each weight is one fused kernel launch; the NaN/Inf check runs once over all scales (one
    device synchronisation for the whole model, not one per weight) and raises ``NonFiniteError``.
    """
    out: Payload = {}
    quantized: list[QuantizedTensor] = []
    for name, w in weights.items():
        if name in fp8_weight_names:
            q = quantize_weight(w, spec, check_finite=False)
            quantized.append(q)
            out[name] = q
        else:
            out[name] = w.to(dtype)
    check_scales_finite(quantized, "requantize_for_rollout")
    return out


def payload_bytes(payload: Payload) -> int:
    total = 0
    for v in payload.values():
        total += v.nbytes if isinstance(v, QuantizedTensor) else v.numel() * v.element_size()
    return total


def verify_engine_weights(engine: RolloutEngine, expected: Payload, version: int) -> None:
    """Raise ``SyncVerificationError`` unless the engine holds ``expected`` exactly and serves ``version``."""
    if engine.policy_version != version:
        raise SyncVerificationError(f"engine serves policy version {engine.policy_version}, expected {version}")
    held = engine.held_weights()
    shard = getattr(engine, "expected_shard", None)  # a tensor-parallel engine holds its part of each weight
    for name, want in expected.items():
        if shard is not None:
            want = shard(name, want)
        got = held.get(name)
        if got is None:
            raise SyncVerificationError(f"engine holds no weight {name!r}")
        if isinstance(want, QuantizedTensor):
            if not isinstance(got, QuantizedTensor):
                raise SyncVerificationError(f"{name}: engine holds a high-precision tensor, FP8 was pushed")
            same = torch.equal(got.data.view(torch.uint8).cpu(), want.data.view(torch.uint8).cpu()) and torch.equal(
                got.scale_inv.cpu(), want.scale_inv.cpu()
            )
        else:
            same = not isinstance(got, QuantizedTensor) and torch.equal(got.cpu(), want.cpu())
        if not same:
            raise SyncVerificationError(f"{name}: engine weight differs from the pushed weight")
