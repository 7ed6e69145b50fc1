"""The NCCL sync's byte layout without a process group: layouts, bucket plans, pack/unpack, checksums."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fp8rl.models import make_tiny_model
from fp8rl.models.layers import fp8_module_names
from fp8rl.quant import QuantizedTensor, QuantSpec, quantize
from fp8rl.sync import SyncVerificationError, requantize_for_rollout
from fp8rl.sync.base import Payload
from fp8rl.sync.buckets import (
    ALIGN,
    LayoutEntry,
    SyncLayout,
    empty_payload,
    layout_of,
    pack_bucket,
    payload_checksums,
    plan_buckets,
    unpack_bucket,
)


def _plain(name: str, nbytes: int) -> LayoutEntry:
    return LayoutEntry(name, "tensor", (nbytes,), "uint8")


def _mixed_payload() -> Payload:
    """A requantized tiny-odd model (partial 128x128 tiles) plus every other granularity, format and dtype."""
    model, _ = make_tiny_model("tiny-odd", seed=0)
    fp8 = {n + ".weight" for n in fp8_module_names(model)}
    payload = requantize_for_rollout(model.state_dict(), fp8, QuantSpec())
    g = torch.Generator().manual_seed(1)
    w = torch.randn(37, 53, generator=g)
    payload["extra.tensorwise"] = quantize(w, "tensor")  # scale shape ()
    payload["extra.rowwise_e5m2"] = quantize(w, "row", fmt="e5m2")  # scale [37, 1]
    payload["extra.act_blocks"] = quantize(torch.randn(3, 5, 300, generator=g), "block", block=(1, 128))
    payload["extra.fp32"] = torch.randn(7, generator=g)
    payload["extra.empty"] = torch.empty(0, 4, dtype=torch.bfloat16)
    payload["extra.int64"] = torch.arange(5)
    return payload


def _same_bytes(a: torch.Tensor | QuantizedTensor, b: torch.Tensor | QuantizedTensor) -> bool:
    if isinstance(a, QuantizedTensor):
        assert isinstance(b, QuantizedTensor)
        return (
            torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
            and a.data.dtype == b.data.dtype
            and torch.equal(a.scale_inv, b.scale_inv)
            and (a.granularity, a.fmt, a.block) == (b.granularity, b.fmt, b.block)
        )
    assert isinstance(b, torch.Tensor)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1), b.reshape(-1))


def test_plan_keeps_order_and_sizes_and_isolates_an_oversize_entry() -> None:
    layout = SyncLayout(tuple(_plain(f"t{i}", n) for i, n in enumerate([40, 40, 40, 500, 8, 100, 100])))
    buckets = plan_buckets(layout, bucket_bytes=128)
    names = [[s.entry.name for s in b.slots] for b in buckets]
    # 40 -> 48 bytes aligned: two fit in 128, the third does not; 500 > 128 stands alone
    assert names == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"], ["t6"]]
    assert [b.nbytes for b in buckets] == [96, 48, 512, 128, 112]
    assert [s.offset for s in buckets[3].slots] == [0, 16]
    assert plan_buckets(SyncLayout(()), 128) == []
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(layout, 0)


@given(st.lists(st.integers(0, 300), max_size=30), st.integers(1, 400))
def test_plan_is_greedy_aligned_and_complete(sizes: list[int], bucket_bytes: int) -> None:
    layout = SyncLayout(tuple(_plain(f"t{i}", n) for i, n in enumerate(sizes)))
    buckets = plan_buckets(layout, bucket_bytes)
    assert [s.entry for b in buckets for s in b.slots] == list(layout.entries)
    for i, b in enumerate(buckets):
        assert all(s.offset % ALIGN == 0 for s in b.slots)
        ends = [s.offset + s.entry.packed_nbytes for s in b.slots]
        assert ends[-1] == b.nbytes and all(e <= s.offset for e, s in zip(ends, b.slots[1:], strict=False))
        assert b.nbytes <= bucket_bytes or len(b.slots) == 1  # only a lone oversize entry exceeds the size
        if i + 1 < len(buckets):  # greedy: the next entry did not fit
            assert b.nbytes + buckets[i + 1].slots[0].entry.packed_nbytes > bucket_bytes


def test_pack_unpack_round_trip_is_bit_exact_and_layout_pickles() -> None:
    payload = _mixed_payload()
    layout = layout_of(payload)
    assert [e.name for e in layout.entries] == list(payload)
    assert layout.nbytes == sum(
        v.nbytes if isinstance(v, QuantizedTensor) else v.numel() * v.element_size() for v in payload.values()
    )
    again = pickle.loads(pickle.dumps(layout))
    assert again == layout and again.fingerprint == layout.fingerprint
    assert len(pickle.dumps(layout)) < 10_000
    buckets = plan_buckets(layout, bucket_bytes=4096)
    assert len(buckets) > 5 and any(len(b.slots) == 1 and b.nbytes > 4096 for b in buckets)
    received: Payload = {}
    for bucket in buckets:
        wire = torch.full((bucket.nbytes,), 0xAB, dtype=torch.uint8)  # padding bytes are never read
        pack_bucket(payload, bucket, wire)
        received.update(
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in unpack_bucket(wire, bucket).items()}
        )
    assert list(received) == list(payload)
    assert all(_same_bytes(payload[k], received[k]) for k in payload)
    assert layout_of(received) == layout


def test_fingerprint_tells_layouts_apart() -> None:
    base = SyncLayout((_plain("a", 4), _plain("b", 8)))
    assert SyncLayout((_plain("a", 4), _plain("b", 8))).fingerprint == base.fingerprint
    assert SyncLayout((_plain("b", 8), _plain("a", 4))).fingerprint != base.fingerprint
    assert SyncLayout((_plain("a", 4), _plain("b", 9))).fingerprint != base.fingerprint
    assert 0 <= base.fingerprint < 2**63


def test_checksums_see_one_flipped_byte_and_wrong_shapes() -> None:
    payload = _mixed_payload()
    layout = layout_of(payload)
    sums = payload_checksums(payload, layout, "cpu")
    assert sums.shape == (len(layout), 4) and sums.dtype == torch.int64
    copy = empty_payload(layout, "cpu")
    for name, value in payload.items():
        dst = copy[name]
        if isinstance(value, QuantizedTensor):
            assert isinstance(dst, QuantizedTensor)
            dst.data.copy_(value.data)
            dst.scale_inv.copy_(value.scale_inv)
        else:
            assert isinstance(dst, torch.Tensor)
            dst.copy_(value)
    assert torch.equal(payload_checksums(copy, layout, "cpu"), sums)
    name = "model.layers.1.mlp.down_proj.weight"
    q = copy[name]
    assert isinstance(q, QuantizedTensor)
    q.data.view(torch.uint8)[7, 11] ^= 1
    changed = (payload_checksums(copy, layout, "cpu") != sums).any(dim=1).nonzero().flatten().tolist()
    assert [layout.entries[i].name for i in changed] == [name]
    # two bytes swapped keep the plain sum but not the position-weighted one
    t = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    one = SyncLayout((LayoutEntry("t", "tensor", (4,), "uint8"),))
    a = payload_checksums({"t": t}, one, "cpu")
    b = payload_checksums({"t": t[[1, 0, 2, 3]]}, one, "cpu")
    assert a[0, 0] == b[0, 0] and a[0, 1] != b[0, 1]
    with pytest.raises(SyncVerificationError, match="held as"):
        payload_checksums({**copy, "lm_head.weight": torch.zeros(3, dtype=torch.bfloat16)}, layout, "cpu")
    with pytest.raises(SyncVerificationError, match="missing"):
        payload_checksums({}, layout, "cpu")
