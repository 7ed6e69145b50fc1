"""Weight sync between two processes on one GPU through CUDA IPC: no host copy, no collective.

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
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from fp8rl.quant import QuantizedTensor
from fp8rl.sync.buckets import Bucket, SyncLayout, layout_of, pack_bucket, plan_buckets, unpack_bucket
from fp8rl.sync.inprocess import Payload

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


__all__ = [
    "IpcUnavailableError",
    "SharedPayload",
    "device_uuid",
    "local_device",
    "open_payload",
    "release",
    "share_payload",
]
