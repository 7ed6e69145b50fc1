"""The in-process ``WeightSync``: requantize, load in place, optionally verify bit for bit."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from fp8rl.quant import QuantizedTensor, QuantSpec, quantize_weight
from fp8rl.quant.quantize import check_scales_finite
from fp8rl.rollout.base import RolloutEngine

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


class WeightSync(Protocol):
    """Given weights (the trainer's, in this process) -> the engine, requantized, as policy ``version``."""

    def push(self, weights: Mapping[str, torch.Tensor], version: int) -> SyncStats: ...


class PolicySync(Protocol):
    """The trainer's current weights -> the engine(s), requantized, as policy ``version``, wherever both live: the
    one-process parts' ``push_weights`` and each Ray transport (``fp8rl.cluster.transports``)."""

    def push(self, version: int) -> SyncStats: ...


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


class InProcessWeightSync:
    """Push into an engine living in the same process (the embedded default, and the CPU tests)."""

    def __init__(
        self, engine: RolloutEngine, fp8_weight_names: set[str], spec: QuantSpec, verify: bool = False
    ) -> None:
        self.engine = engine
        self.fp8_weight_names = fp8_weight_names
        self.spec = spec
        self.verify = verify

    def push(self, weights: Mapping[str, torch.Tensor], version: int) -> SyncStats:
        t0 = time.perf_counter()
        payload = requantize_for_rollout(weights, self.fp8_weight_names, self.spec)
        t1 = time.perf_counter()
        self.engine.load_weights(payload, version)
        t2 = time.perf_counter()
        if self.verify:
            verify_engine_weights(self.engine, payload, version)
        return SyncStats(version, payload_bytes(payload), len(payload), t1 - t0, t2 - t1, self.verify)
