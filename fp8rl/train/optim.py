"""AdamW over FP32 master weights for a model that computes in BF16.

The model's parameters stay bf16 (the numerics the rollout engine also runs); each has an
fp32 master copy, gradients are accumulated in fp32 across micro-batches, and after the
AdamW step the masters are rounded back into the bf16 parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


class MasterWeightAdamW:
    def __init__(
        self,
        params: list[nn.Parameter],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.master = [nn.Parameter(p.detach().to(torch.float32).clone()) for p in self.params]
        for m in self.master:
            m.grad = torch.zeros_like(m)
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)
        # Data parallelism: sums the accumulated fp32 gradients across ranks before clipping
        # (set by the worker that owns the process group; None in one process).
        self.grad_reducer: Callable[[list[torch.Tensor]], None] | None = None

    @torch.no_grad()
    def accumulate(self, scale: float = 1.0) -> None:
        """Move the parameters' (bf16) gradients into the fp32 accumulators."""
        for p, m in zip(self.params, self.master, strict=True):
            if p.grad is not None:
                assert m.grad is not None
                m.grad.add_(p.grad.to(torch.float32), alpha=scale)
                p.grad = None

    @torch.no_grad()
    def step(self, grad_clip: float) -> float:
        """Clip, step, copy masters into the model; returns the pre-clip global grad norm."""
        if self.grad_reducer is not None:
            self.grad_reducer([m.grad for m in self.master if m.grad is not None])
        norm = float(nn.utils.clip_grad_norm_(self.master, grad_clip))
        if math.isfinite(norm):
            self.optimizer.step()
            for p, m in zip(self.params, self.master, strict=True):
                p.copy_(m)
        for m in self.master:
            assert m.grad is not None
            m.grad.zero_()
        return norm


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str):  # type: ignore[no-untyped-def]
    """Linear warm-up, then constant or cosine decay to 10% (a multiplier of the base lr)."""

    def f(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "cosine":
            progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return f
