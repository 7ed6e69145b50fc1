"""``fp8rl.train.token_logprobs`` on a GPU at a Llama-3 vocabulary: the values of the plain fp32 log-softmax (same
per-row kernels), its gradient within bf16 rounding, and the head's peak memory cut (no fp32 copy of the whole
logits, none kept for the backward)."""

from __future__ import annotations

import pytest
import torch

from fp8rl.train.token_logprobs import token_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _peak_and_grad(fn, logits: torch.Tensor, targets: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    leaf = logits.clone().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp = fn(leaf[:, 1:, :], targets)
    lp.sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, lp.detach(), leaf.grad


def test_chunked_head_on_cuda_same_values_less_memory() -> None:
    vocab, n, t = 128_256, 2, 2048  # 4k tokens: 2.1 GB per fp32 copy of the logits
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(n, t + 1, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (n, t), device="cuda", generator=g)

    def plain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.float().div_(0.8).log_softmax(-1).gather(-1, y[..., None]).squeeze(-1)

    def chunked(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return token_logprobs(x, y, 0.8)

    peak_plain, lp_plain, grad_plain = _peak_and_grad(plain, logits, targets)
    peak_chunked, lp_chunked, grad_chunked = _peak_and_grad(chunked, logits, targets)
    print(f"head peak over the logits: plain {peak_plain / 2**30:.2f} GiB, chunked {peak_chunked / 2**30:.2f} GiB")
    torch.testing.assert_close(lp_chunked, lp_plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_chunked.float(), grad_plain.float(), rtol=1e-2, atol=1e-6)
    assert peak_chunked < peak_plain / 2
