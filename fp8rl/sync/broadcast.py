"""The bucketed broadcast behind ``ray.sync: collective`` (``fp8rl.sync.collective``): NCCL on GPU, gloo on CPU.

The trainer requantizes ONCE with the rollout recipe (``requantize_for_rollout``), so an FP8
recipe sends FP8 bytes: 1 byte per value plus a float32 scale per 128x128 tile, against 2
bytes per value for bf16.  The payload travels as raw bytes in buckets laid out by
``fp8rl.sync.buckets`` from a ``SyncLayout`` the receivers were handed once, and arrives bit
for bit.  Each rank holds ONE bucket buffer (``max(bucket_bytes, largest entry)`` bytes) at a
time: the sender packs into it, every rank ``broadcast``s it, and a receiver unpacks views of
it straight into the engine (``receive_into``: ``engine.load_weights`` copies in place, no
second full copy) or into caller-provided tensors (``broadcast_payload(into=...)``).

Protocol, per push; every step is a collective of the whole group, so no rank waits forever:
  1. header from ``src``: layout fingerprint, bucket size, policy version, verify flag;
     every rank checks it against its own layout and all agree (all-reduce MAX of an error code);
  2. the buckets;
  3. with verify: the sender's per-tensor checksums; each receiver checks the engine holds
     exactly the bytes it received (``verify_engine_weights``, bucket by bucket) and that
     their checksums equal the sender's;
  4. agreement: a receiver that failed to load or verify has still drained every bucket, and
     now every rank raises (``SyncVerificationError`` or ``SyncTransportError``).
The engine serves the new version only once the last bucket is loaded.

The process group is the caller's: a registered group (``None`` = the default one) or a
group of its own from ``new_sync_group`` (trainer rank 0 plus the rollout workers, beside the
trainers' data-parallel group).  ``src`` is a rank within that group.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from fp8rl.quant import QuantizedTensor
from fp8rl.rollout.base import RolloutEngine
from fp8rl.sync.base import (
    Payload,
    SyncStats,
    SyncVerificationError,
    verify_engine_weights,
)
from fp8rl.sync.buckets import (
    Bucket,
    SyncLayout,
    entry_of,
    layout_mismatch,
    pack_bucket,
    payload_checksums,
    plan_buckets,
    unpack_bucket,
)

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
_MAGIC = 0x46_50_38_53_59_4E_43  # "FP8SYNC" in ASCII
_OK, _VERIFY_FAILED, _FAILED = 0, 1, 2

# a torch.distributed ProcessGroup or a standalone backend (``new_sync_group``); both have broadcast/allreduce
SyncGroup = Any


class SyncTransportError(RuntimeError):
    """The ranks of a sync disagree (layout, version) or a receiver failed to load; raised on every rank."""


# ---- collectives -------------------------------------------------------------------------------------
def _group(group: SyncGroup | None) -> SyncGroup:
    if group is not None:
        return group
    if dist.group.WORLD is None:
        raise ValueError("no default process group: call torch.distributed.init_process_group or pass group=")
    return dist.group.WORLD


def _broadcast(group: SyncGroup, tensor: torch.Tensor, src: int) -> None:
    group.broadcast(tensor, src).wait()


def _agree(group: SyncGroup, device: torch.device, code: int) -> int:
    """The worst (largest) error code over all ranks."""
    t = torch.tensor([code], dtype=torch.int64, device=device)
    group.allreduce([t], dist.ReduceOp.MAX).wait()
    return int(t.item())


def new_sync_group(
    init_method: str, rank: int, world_size: int, backend: Literal["nccl", "gloo"], timeout_s: float = 300.0
) -> SyncGroup:
    """A process group for the sync alone (e.g. trainer rank 0 + rollout workers), beside the default group.

    ``init_method`` is a rendezvous URL (``tcp://host:port``, ``env://``) of its own.  NCCL
    ranks need their CUDA device set (``torch.cuda.set_device``) before the first push.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore("fp8rl-sync/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")


# ---- the protocol ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Header:
    fingerprint: int
    bucket_bytes: int
    version: int
    verify: bool

    def tensor(self, device: torch.device) -> torch.Tensor:
        values = [_MAGIC, self.fingerprint, self.bucket_bytes, self.version, int(self.verify)]
        return torch.tensor(values, dtype=torch.int64, device=device)

    @classmethod
    def exchange(cls, group: SyncGroup, src: int, device: torch.device, header: _Header | None) -> _Header | None:
        """Broadcast ``header`` from ``src``; receivers get it (None if it is not one of ours)."""
        t = header.tensor(device) if header is not None else torch.zeros(5, dtype=torch.int64, device=device)
        _broadcast(group, t, src)
        magic, fingerprint, bucket_bytes, version, verify = t.tolist()
        return cls(fingerprint, bucket_bytes, version, bool(verify)) if magic == _MAGIC else None


def _bucket_buffer(buckets: list[Bucket], device: torch.device) -> torch.Tensor:
    """One uint8 buffer that every bucket is packed into (or received into) in turn: the largest's size."""
    return torch.empty(max((b.nbytes for b in buckets), default=0), dtype=torch.uint8, device=device)


def _raise_for(worst: int, own: BaseException | str | None, when: str) -> None:
    """After an agreement: raise on every rank if any rank failed (its own error if it has one)."""
    if isinstance(own, SyncVerificationError):
        raise own
    if isinstance(own, BaseException):
        raise SyncTransportError(f"{when}: {type(own).__name__}: {own}") from own
    if own is not None:
        raise SyncTransportError(f"{when}: {own}")
    if worst == _VERIFY_FAILED:
        raise SyncVerificationError(f"{when}: another rank's weights differ from the pushed payload")
    if worst != _OK:
        raise SyncTransportError(f"{when}: another rank failed (see its error)")


def _send(
    payload: Payload,
    layout: SyncLayout,
    group: SyncGroup,
    src: int,
    device: torch.device,
    bucket_bytes: int,
    version: int,
    verify: bool,
) -> None:
    problem = layout_mismatch(payload, layout)
    _Header.exchange(group, src, device, _Header(layout.fingerprint, bucket_bytes, version, verify))
    _raise_for(_agree(group, device, _FAILED if problem else _OK), problem, "sync header")
    buckets = plan_buckets(layout, bucket_bytes)
    buffer = _bucket_buffer(buckets, device)
    for bucket in buckets:
        view = buffer[: bucket.nbytes]
        pack_bucket(payload, bucket, view)
        _broadcast(group, view, src)
    del buffer
    if verify:
        _broadcast(group, payload_checksums(payload, layout, device), src)
    _raise_for(_agree(group, device, _OK), None, f"sync of version {version}")


def _receive(
    layout: SyncLayout,
    group: SyncGroup,
    src: int,
    device: torch.device,
    expected_version: int | None,
    consume: Callable[[Payload, bool, _Header], None],
    held: Callable[[], Mapping[str, torch.Tensor | QuantizedTensor]],
) -> _Header:
    """Receive one push; ``consume(part, last, header)`` gets each bucket's entries as views of the bucket
    buffer (``last`` for the final one); ``held()`` is what the verify mode's checksums are taken of."""
    header = _Header.exchange(group, src, device, None)
    problem = None
    if header is None:
        problem = "the sender's header is not an fp8rl sync header"
    elif header.fingerprint != layout.fingerprint:
        problem = "the sender's layout differs from this receiver's (hand the receivers layout_of(payload) again)"
    elif expected_version is not None and header.version != expected_version:
        problem = f"the sender pushes version {header.version}, this receiver expects {expected_version}"
    _raise_for(_agree(group, device, _FAILED if problem else _OK), problem, "sync header")
    assert header is not None
    buckets = plan_buckets(layout, header.bucket_bytes)
    buffer = _bucket_buffer(buckets, device)
    error: BaseException | None = None
    for i, bucket in enumerate(buckets):
        view = buffer[: bucket.nbytes]
        _broadcast(group, view, src)
        if error is None:  # after a failure keep draining, so the sender is not left waiting
            try:
                consume(unpack_bucket(view, bucket), i == len(buckets) - 1, header)
            except Exception as e:
                error = e
    del buffer
    if not buckets and error is None:
        try:
            consume({}, True, header)
        except Exception as e:
            error = e
    if header.verify:
        want = torch.empty((len(layout), 4), dtype=torch.int64, device=device)
        _broadcast(group, want, src)
        if error is None:
            error = _compare_checksums(held(), layout, device, want)
    code = _OK if error is None else _VERIFY_FAILED if isinstance(error, SyncVerificationError) else _FAILED
    _raise_for(_agree(group, device, code), error, f"sync of version {header.version}")
    return header


def _compare_checksums(
    held: Mapping[str, torch.Tensor | QuantizedTensor], layout: SyncLayout, device: torch.device, want: torch.Tensor
) -> SyncVerificationError | None:
    try:
        got = payload_checksums(held, layout, device)
    except SyncVerificationError as e:
        return e
    differs = (got != want).any(dim=1).nonzero().flatten().tolist()
    if differs:
        names = [layout.entries[i].name for i in differs[:3]]
        return SyncVerificationError(f"{len(differs)} weight(s) differ from the sender's bytes, e.g. {names}")
    return None


def broadcast_payload(
    payload: Payload | None,
    layout: SyncLayout,
    src: int = 0,
    group: SyncGroup | None = None,
    device: torch.device | str = "cpu",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    into: Mapping[str, torch.Tensor | QuantizedTensor] | None = None,
    verify: bool = False,
    version: int = 0,
) -> Payload:
    """Broadcast ``payload`` (given on ``src`` only) to every rank of ``group``; returns it on every rank.

    The sender chooses ``bucket_bytes``, ``verify`` and ``version`` (the header carries them).
    A receiver returns fresh tensors on ``device``, or copies into ``into`` (same names,
    shapes and dtypes; FP8 entries as QuantizedTensor) and returns that.  With ``verify``
    every receiver's result is checksummed against the sender's payload; any failure raises
    on every rank.
    """
    g, dev = _group(group), torch.device(device)
    if g.rank() == src:
        if payload is None:
            raise ValueError("the sending rank must pass the payload")
        _send(payload, layout, g, src, dev, bucket_bytes, version, verify)
        return payload
    if payload is not None:
        raise ValueError("only the sending rank passes a payload")
    out: Payload = {}

    def keep(part: Payload, _last: bool, _header: _Header) -> None:
        for name, value in part.items():
            if into is None:
                out[name] = _clone(value)
            else:
                _copy_into(into, name, value)
                out[name] = into[name]

    _receive(layout, g, src, dev, None, keep, lambda: out)
    return out


def _clone(value: torch.Tensor | QuantizedTensor) -> torch.Tensor | QuantizedTensor:
    if isinstance(value, QuantizedTensor):
        return QuantizedTensor(value.data.clone(), value.scale_inv.clone(), value.granularity, value.fmt, value.block)
    return value.clone()


def _copy_into(
    into: Mapping[str, torch.Tensor | QuantizedTensor], name: str, value: torch.Tensor | QuantizedTensor
) -> None:
    dst = into.get(name)
    if dst is None or entry_of(name, dst) != entry_of(name, value):
        raise ValueError(
            f"{name}: destination {None if dst is None else entry_of(name, dst)} cannot hold {entry_of(name, value)}"
        )
    if isinstance(dst, QuantizedTensor):
        assert isinstance(value, QuantizedTensor)
        dst.data.copy_(value.data)
        dst.scale_inv.copy_(value.scale_inv)
    else:
        assert isinstance(value, torch.Tensor)
        dst.copy_(value)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def receive_into(
    engine: RolloutEngine,
    layout: SyncLayout,
    version: int | None = None,
    *,
    device: torch.device | str,
    group: SyncGroup | None = None,
    src: int = 0,
) -> SyncStats:
    """Receive one push into ``engine`` in place, bucket by bucket; returns the stats of this receiver.

    ``version``, if given, must be the version pushed.  The engine keeps serving its old
    version until the last bucket is loaded.  Verification is the sender's choice: with it,
    every bucket is checked bit for bit against the engine's weights right after loading,
    and the engine's weights are checksummed against the sender's payload.
    """
    g, dev = _group(group), torch.device(device)
    previous = engine.policy_version

    def load(part: Payload, last: bool, header: _Header) -> None:
        v = header.version if last else previous
        engine.load_weights(part, v)
        if header.verify:
            verify_engine_weights(engine, part, v)

    t0 = time.perf_counter()
    header = _receive(layout, g, src, dev, version, load, engine.held_weights)
    synchronize(dev)
    return SyncStats(header.version, layout.nbytes, len(layout), 0.0, time.perf_counter() - t0, header.verify)
