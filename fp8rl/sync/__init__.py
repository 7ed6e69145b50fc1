"""Requantized weight sync, trainer -> rollout engine, as a versioned protocol.

After every optimizer step the trainer's weights are requantized ONCE with the rollout
recipe (FP8 + scales for the engine's FP8 linears, bf16 for the rest) and pushed with a
policy version; the engine loads them in place and then serves that version.  The verify
mode reads the engine's weights back and proves they equal quantize(trainer weights) bit
for bit.  This package has the in-process implementation, the NCCL broadcast and the CUDA IPC payloads; the Ray
transports that use them are ``fp8rl.cluster.transports``.
"""

from fp8rl.sync.inprocess import (
    InProcessWeightSync,
    PolicySync,
    SyncStats,
    SyncVerificationError,
    WeightSync,
    payload_bytes,
    requantize_for_rollout,
    verify_engine_weights,
)
from fp8rl.sync.nccl import NcclWeightSync, SyncLayout, broadcast_payload, layout_of, new_sync_group, receive_into

__all__ = [
    "InProcessWeightSync",
    "NcclWeightSync",
    "PolicySync",
    "SyncLayout",
    "SyncStats",
    "SyncVerificationError",
    "WeightSync",
    "broadcast_payload",
    "layout_of",
    "new_sync_group",
    "payload_bytes",
    "receive_into",
    "requantize_for_rollout",
    "verify_engine_weights",
]
