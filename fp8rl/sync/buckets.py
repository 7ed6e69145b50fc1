"""A sync payload as bytes: its layout, the buckets it is packed into, and checksums of it.

Layout.  ``layout_of(payload)`` is the ordered list of what is sent (names, kinds, shapes,
dtypes, FP8 granularity/format/block): small and picklable, handed to the receivers once
(by Ray or any side channel).  Sender and receivers plan the same buckets from it
(``plan_buckets``), so they agree on every byte offset without sending metadata per push.

Buckets.  Consecutive entries are packed into one contiguous uint8 buffer of at most
``bucket_bytes``; an entry larger than that gets a bucket of its own, and an FP8 entry's
values and scales share a bucket, so every bucket holds whole entries.  FP8 values travel as
their bytes, so any FP8 dtype crosses any backend (gloo and NCCL before 2.24 have none).
Each entry's data and scales start at a multiple of 16 bytes: ``Tensor.view(dtype)`` needs
the byte offset to be a multiple of the element size (4 for float32 scales, 8 for float64),
and 16-byte aligned starts let the copy kernels that pack and unpack use vector loads.  The
padding is at most 15 bytes per tensor.

Checksums.  ``payload_checksums`` gives two sums of each tensor's bytes b_i, in the manner of
Fletcher's: sum b_i and sum b_i * ((i mod 2^16) + 1), both mod 2^61 - 1.  They catch a
changed, lost or shifted byte (not a deliberate forgery) and run on the tensors' own device,
at memory speed on a GPU.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

from fp8rl.quant import QuantizedTensor, get_format
from fp8rl.sync.base import Payload, SyncVerificationError

ALIGN = 16
_CHUNK = 1 << 24  # checksum bytes in 16 MiB pieces (int32 temporaries of 64 MiB)
_MOD = (1 << 61) - 1


@dataclass(frozen=True)
class LayoutEntry:
    """One payload entry: a plain tensor, or FP8 values plus float32 scales (``kind == "fp8"``)."""

    name: str
    kind: Literal["tensor", "fp8"]
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16", "float8_e4m3fn"
    scale_shape: tuple[int, ...] | None = None
    scale_dtype: str | None = None
    granularity: str | None = None
    fmt: str | None = None  # "e4m3" | "e5m2"
    block: tuple[int, int] | None = None

    @property
    def data_nbytes(self) -> int:
        return math.prod(self.shape) * _dtype(self.dtype).itemsize

    @property
    def scale_nbytes(self) -> int:
        if self.scale_shape is None or self.scale_dtype is None:
            return 0
        return math.prod(self.scale_shape) * _dtype(self.scale_dtype).itemsize

    @property
    def packed_nbytes(self) -> int:
        """Bytes it takes in a bucket, alignment padding included."""
        return _aligned(self.data_nbytes) + _aligned(self.scale_nbytes)


@dataclass(frozen=True)
class SyncLayout:
    """What a push sends, in order; both sides derive the byte offsets from it."""

    entries: tuple[LayoutEntry, ...]

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        """Payload bytes (values and scales, no padding): ``payload_bytes`` of the payload."""
        return sum(e.data_nbytes + e.scale_nbytes for e in self.entries)

    @cached_property
    def fingerprint(self) -> int:
        """63-bit hash of the entries, compared in every push's header."""
        digest = hashlib.blake2b(repr(self.entries).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class Slot:
    """Where one entry lies in its bucket: data at ``offset``, FP8 scales at ``scale_offset``."""

    entry: LayoutEntry
    offset: int
    scale_offset: int | None


@dataclass(frozen=True)
class Bucket:
    slots: tuple[Slot, ...]
    nbytes: int


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def entry_of(name: str, value: torch.Tensor | QuantizedTensor) -> LayoutEntry:
    """The layout entry ``value`` has under ``name``."""
    if isinstance(value, QuantizedTensor):
        return LayoutEntry(
            name,
            "fp8",
            tuple(value.data.shape),
            _dtype_name(value.data.dtype),
            tuple(value.scale_inv.shape),
            _dtype_name(value.scale_inv.dtype),
            value.granularity,
            value.fmt.name,
            None if value.block is None else (int(value.block[0]), int(value.block[1])),
        )
    return LayoutEntry(name, "tensor", tuple(value.shape), _dtype_name(value.dtype))


def layout_of(payload: Payload) -> SyncLayout:
    """The layout of ``payload`` (insertion order)."""
    return SyncLayout(tuple(entry_of(name, value) for name, value in payload.items()))


def plan_buckets(layout: SyncLayout, bucket_bytes: int) -> list[Bucket]:
    """Consecutive entries in buckets of at most ``bucket_bytes``; a larger entry gets its own bucket."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    used = 0
    for e in layout.entries:
        if slots and used + e.packed_nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(slots), used))
            slots, used = [], 0
        scale_offset = used + _aligned(e.data_nbytes) if e.kind == "fp8" else None
        slots.append(Slot(e, used, scale_offset))
        used += e.packed_nbytes
    if slots:
        buckets.append(Bucket(tuple(slots), used))
    return buckets


def _typed(buffer: torch.Tensor, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return buffer[offset : offset + nbytes].view(_dtype(dtype)).view(shape)


def _views(buffer: torch.Tensor, slot: Slot) -> tuple[torch.Tensor, torch.Tensor | None]:
    e = slot.entry
    data = _typed(buffer, slot.offset, e.data_nbytes, e.dtype, e.shape)
    if slot.scale_offset is None or e.scale_shape is None or e.scale_dtype is None:
        return data, None
    return data, _typed(buffer, slot.scale_offset, e.scale_nbytes, e.scale_dtype, e.scale_shape)


def pack_bucket(payload: Payload, bucket: Bucket, buffer: torch.Tensor) -> None:
    """Copy the bucket's entries of ``payload`` into ``buffer`` (uint8, ``bucket.nbytes`` long)."""
    for slot in bucket.slots:
        value = payload[slot.entry.name]
        data, scale = _views(buffer, slot)
        if isinstance(value, QuantizedTensor):
            assert scale is not None
            data.copy_(value.data)
            scale.copy_(value.scale_inv)
        else:
            data.copy_(value)


def unpack_bucket(buffer: torch.Tensor, bucket: Bucket) -> Payload:
    """The bucket's entries as views of ``buffer`` (valid until the buffer is reused)."""
    out: Payload = {}
    for slot in bucket.slots:
        e = slot.entry
        data, scale = _views(buffer, slot)
        if scale is None:
            out[e.name] = data
        else:
            assert e.fmt is not None
            out[e.name] = QuantizedTensor(data, scale, e.granularity, get_format(e.fmt), e.block)  # type: ignore[arg-type]
    return out


def empty_payload(layout: SyncLayout, device: torch.device | str) -> Payload:
    """Uninitialised tensors of ``layout`` on ``device``: destinations for ``broadcast_payload(into=...)``."""
    out: Payload = {}
    for e in layout.entries:
        data = torch.empty(e.shape, dtype=_dtype(e.dtype), device=device)
        if e.kind == "fp8":
            assert e.scale_shape is not None and e.scale_dtype is not None and e.fmt is not None
            scale = torch.empty(e.scale_shape, dtype=_dtype(e.scale_dtype), device=device)
            out[e.name] = QuantizedTensor(data, scale, e.granularity, get_format(e.fmt), e.block)  # type: ignore[arg-type]
        else:
            out[e.name] = data
    return out


def layout_mismatch(payload: Mapping[str, torch.Tensor | QuantizedTensor], layout: SyncLayout) -> str | None:
    """Why ``payload`` does not have ``layout`` (names, kinds, shapes, dtypes), or None."""
    if list(payload) != [e.name for e in layout.entries]:
        missing = sorted({e.name for e in layout.entries} - set(payload))
        extra = sorted(set(payload) - {e.name for e in layout.entries})
        return f"payload names differ from the layout (missing {missing[:3]}, extra {extra[:3]}, or another order)"
    for e in layout.entries:
        got = entry_of(e.name, payload[e.name])
        if got != e:
            return f"{e.name}: payload has {got}, layout says {e}"
    return None


def _bytes_checksum(t: torch.Tensor) -> torch.Tensor:
    """Two position-weighted sums of the bytes of ``t`` (int64 [2], on its device); a checksum, not a hash."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    s1 = torch.zeros((), dtype=torch.int64, device=b.device)
    s2 = torch.zeros((), dtype=torch.int64, device=b.device)
    for start in range(0, b.numel(), _CHUNK):
        x = b[start : start + _CHUNK].to(torch.int32)
        # _CHUNK is a multiple of 2^16, so the weight of byte i is (i mod 2^16) + 1 in every chunk
        w = (torch.arange(x.numel(), dtype=torch.int32, device=b.device) & 0xFFFF) + 1
        s1 = (s1 + x.sum(dtype=torch.int64)) % _MOD
        s2 = (s2 + (x * w).sum(dtype=torch.int64)) % _MOD
    return torch.stack([s1, s2])


def payload_checksums(
    payload: Mapping[str, torch.Tensor | QuantizedTensor], layout: SyncLayout, device: torch.device | str
) -> torch.Tensor:
    """int64 ``[len(layout), 4]`` on ``device``: checksums of each entry's data bytes and scale bytes (0 if none).

    Raises ``SyncVerificationError`` when an entry is missing or has another kind, shape or dtype.
    """
    rows = []
    for e in layout.entries:
        value = payload.get(e.name)
        if value is None:
            raise SyncVerificationError(f"{e.name}: missing")
        if entry_of(e.name, value) != e:
            raise SyncVerificationError(f"{e.name}: held as {entry_of(e.name, value)}, pushed as {e}")
        if isinstance(value, QuantizedTensor):
            parts = [_bytes_checksum(value.data), _bytes_checksum(value.scale_inv)]
        else:
            parts = [_bytes_checksum(value), torch.zeros(2, dtype=torch.int64, device=value.device)]
        rows.append(torch.cat([p.to(device) for p in parts]))
    if not rows:
        return torch.zeros((0, 4), dtype=torch.int64, device=device)
    return torch.stack(rows)
