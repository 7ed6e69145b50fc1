"""What a policy step's memory handling cost, as the step's metrics: ``optimizer_offload_s`` (the optimizer
state's copies to the host and back, with ``optim.offload_optimizer_state``) and, on CUDA, ``cuda_alloc_retries``
(the times the caching allocator had to free its cache and retry a request during the step: memory at its limit,
each retry a synchronising round)."""

from __future__ import annotations

import torch

from fp8rl.train.optim import StateOffload


class StepMemory:
    """``start()`` at the beginning of a step, ``metrics()`` at its end."""

    def __init__(self, device: torch.device, offload: StateOffload | None) -> None:
        self.device, self.offload = device, offload
        self._retries: int | None = None

    def _alloc_retries(self) -> int | None:
        if self.device.type != "cuda":
            return None
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def start(self) -> None:
        """The allocator's retry count so far; the offload's timer restarted (copies between steps, for a
        checkpoint, are not this step's)."""
        if self.offload is not None:
            self.offload.take_seconds()
        self._retries = self._alloc_retries()

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.offload is not None:
            out["optimizer_offload_s"] = self.offload.take_seconds()
        now = self._alloc_retries()
        if now is not None and self._retries is not None:
            out["cuda_alloc_retries"] = float(now - self._retries)
        return out
