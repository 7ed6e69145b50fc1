"""The log-probability of each given token under the model's logits, a chunk of tokens at a time.

The plain way, ``logits.float().div_(T).log_softmax(-1).gather(...)``, materialises two fp32 copies of the logits
and autograd keeps the log-softmax for the backward, which makes a third in it: at a Llama-3 vocabulary (128,256)
a 16k-token micro-batch's head takes ~8.4 GB per fp32 copy, ~25-30 GB at the backward's peak, more than the rest of a
checkpointed 8B layer stack.  Here the forward takes ``[chunk, vocab]`` rows at a time (the same per-row
operations, so the same values) and keeps only the logits themselves (the lm_head's output, bf16) for the
backward, which recomputes each chunk's log-softmax and writes the logits' gradient chunk by chunk, with the
operations of autograd's log-softmax backward (so on the CPU the same bits as the plain path):

    d logp(y) / d z = (onehot(y) - softmax(z)) / T,  z = logits / T

so the head's extra memory is one ``[chunk, vocab]`` fp32 block and the gradient in the logits' dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

CHUNK_BYTES = 256 << 20  # fp32 bytes of one chunk's logits: ~520 tokens at a 128k vocabulary


def _chunks(n: int, t: int, tokens: int) -> Iterator[tuple[int, int, int]]:
    for i in range(n):
        for s in range(0, t, tokens):
            yield i, s, min(t, s + tokens)


def _divides(temperature: float) -> bool:
    return temperature > 0 and temperature != 1.0  # none, or dividing by 1: the same values


def _scaled(block: torch.Tensor, temperature: float) -> torch.Tensor:
    z = block.to(torch.float32, copy=True)  # a copy also of fp32 logits: the backward reads them again
    if _divides(temperature):
        z.div_(temperature)
    return z


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float, tokens: int) -> torch.Tensor:
        n, t, _v = logits.shape
        out = torch.empty((n, t), dtype=torch.float32, device=logits.device)
        for i, s, e in _chunks(n, t, tokens):
            z = _scaled(logits[i, s:e], temperature)
            out[i, s:e] = z.log_softmax(-1).gather(-1, targets[i, s:e, None]).squeeze(-1)
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.tokens = temperature, tokens
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, targets = ctx.saved_tensors
        n, t, _v = logits.shape
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for i, s, e in _chunks(n, t, ctx.tokens):
            g = grad_out[i, s:e, None].float()
            # exp(log_softmax), as autograd's log-softmax backward has it: the same gradient bits
            z = _scaled(logits[i, s:e], ctx.temperature).log_softmax(-1).exp_().mul_(-g)
            z.scatter_add_(-1, targets[i, s:e, None], g)
            if _divides(ctx.temperature):
                z.div_(ctx.temperature)
            grad[i, s:e] = z
        return grad, None, None, None


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk_tokens: int | None = None
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``targets``: ``logits [n, t, vocab]`` (any float dtype, a strided
    view is fine), ``targets [n, t]`` -> fp32 ``[n, t]``; differentiable in ``logits``.  ``temperature <= 0`` means
    none (greedy sampling has no distribution to divide).  ``chunk_tokens``: tokens per chunk (default: what
    fits ``CHUNK_BYTES`` of fp32)."""
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"token_logprobs: logits [n, t, vocab] and targets [n, t], got {tuple(logits.shape)} "
                         f"and {tuple(targets.shape)}")  # fmt: skip
    tokens = chunk_tokens or max(1, CHUNK_BYTES // (4 * logits.shape[-1]))
    out: torch.Tensor = _TokenLogprobs.apply(logits, targets, float(temperature), tokens)
    return out
