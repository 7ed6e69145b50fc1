"""Requantized weight sync, trainer -> rollout engine, as a versioned protocol.

After every optimizer step the trainer's weights are requantized ONCE with the rollout
recipe (FP8 + scales for the engine's FP8 linears, bf16 for the rest) and pushed with a
policy version; the engine loads them in place and then serves that version.  The verify
mode reads the engine's weights back and proves they equal quantize(trainer weights) bit
for bit.

One interface, ``PolicySync.push(version) -> SyncStats`` (``base``), and one module per place the engine lives:
``inprocess`` (one process) and one per ``ray.sync`` value, ``objectstore``, ``collective`` and ``ipc``, each holding
the trainer rank's sender, the rollout worker's receiver and the driver's push (``transport(name)``).  The bytes
under them: ``buckets`` (layout, buckets, checksums) and ``broadcast`` (the bucketed broadcast protocol).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from fp8rl.sync.base import (
    PolicySync,
    SyncStats,
    SyncVerificationError,
    payload_bytes,
    requantize_for_rollout,
    verify_engine_weights,
)
from fp8rl.sync.buckets import SyncLayout, layout_of
from fp8rl.sync.inprocess import InProcessSync

if TYPE_CHECKING:
    from fp8rl.config.run import SyncTransport


def transport(name: SyncTransport) -> ModuleType:
    """The module of the ``ray.sync`` value ``name``: ``sender(...)`` and ``receiver(...)``, which the trainer and
    rollout actors build (``fp8rl.cluster.workers``), and ``policy_sync(...)``, the driver's push."""
    return importlib.import_module(f"{__name__}.{name}")


__all__ = [
    "InProcessSync",
    "PolicySync",
    "SyncLayout",
    "SyncStats",
    "SyncVerificationError",
    "layout_of",
    "payload_bytes",
    "requantize_for_rollout",
    "transport",
    "verify_engine_weights",
]
