"""A sync payload in a form every transport carries: FP8 bytes travel as uint8 views.

Serializers that go through numpy (Ray's object store) and collectives without FP8 types
(NCCL before 2.24, gloo) cannot carry ``float8_e4m3fn`` tensors, so the FP8 values of a
``QuantizedTensor`` are sent as their bytes (a zero-copy ``view(torch.uint8)``) and viewed
back on arrival: the receiver gets bit-identical values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8rl.quant import QuantizedTensor
from fp8rl.sync.inprocess import Payload


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
