"""The in-process ``PolicySync``: engine and trainer in one process (the embedded default, and the CPU tests).

Requantize the trainer's current weights, load them into the engine in place, optionally verify bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from fp8rl.quant import QuantSpec
from fp8rl.rollout.base import RolloutEngine
from fp8rl.sync.base import SyncStats, payload_bytes, requantize_for_rollout, verify_engine_weights


class InProcessSync:
    """Push ``weights()`` (the trainer's, e.g. ``TorchTrainer.hf_state_dict``) into an engine in this process."""

    def __init__(
        self,
        engine: RolloutEngine,
        weights: Callable[[], Mapping[str, torch.Tensor]],
        fp8_weight_names: set[str],
        spec: QuantSpec,
        verify: bool = False,
    ) -> None:
        self.engine = engine
        self.weights = weights
        self.fp8_weight_names = fp8_weight_names
        self.spec = spec
        self.verify = verify

    def push(self, version: int) -> SyncStats:
        weights = self.weights()
        t0 = time.perf_counter()
        payload = requantize_for_rollout(weights, self.fp8_weight_names, self.spec)
        t1 = time.perf_counter()
        self.engine.load_weights(payload, version)
        t2 = time.perf_counter()
        if self.verify:
            verify_engine_weights(self.engine, payload, version)
        return SyncStats(version, payload_bytes(payload), len(payload), t1 - t0, t2 - t1, self.verify)
