"""``fp8rl.train.token_logprobs``: the chunked token log-probabilities against the plain fp32 log-softmax.

The forward runs the same per-row operations, so its values are the reference's exactly; the backward
recomputes each chunk's log-softmax and takes the gradient autograd's log-softmax backward takes, so on bf16
logits (the model's) the gradient has the same bits too (on the CPU; fp32 logits: within fp32 rounding, the
reference there divides out of place)."""

from __future__ import annotations

import pytest
import torch

from fp8rl.train.token_logprobs import token_logprobs


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """The trainer's code before the chunked head (an fp32 copy divided in place; out of place for fp32 logits,
    where ``.float()`` is no copy)."""
    pred = logits.float()
    if temperature > 0:
        pred = pred.div_(temperature) if logits.dtype != torch.float32 else pred / temperature
    return pred.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_chunked_logprobs_match_the_plain_log_softmax(
    dtype: torch.dtype, temperature: float, chunk: int | None
) -> None:
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(3, 20, 97, generator=g) * 4).to(dtype)
    targets = torch.randint(0, 97, (3, 12), generator=g)
    weights = torch.rand(3, 12, generator=g) * (torch.rand(3, 12, generator=g) > 0.3)  # masked tokens: zero grad
    grads = []
    values = []
    for fn in (lambda x: token_logprobs(x, targets, temperature, chunk), lambda x: _reference(x, targets, temperature)):
        leaf = full.clone().requires_grad_(True)
        lp = fn(leaf[:, 7:19, :])  # a strided view, as the trainer passes the response columns
        (lp * weights).sum().backward()
        values.append(lp.detach())
        grads.append(leaf.grad)
    assert values[0].dtype == torch.float32
    assert torch.equal(values[0], values[1])
    assert grads[0].dtype == dtype
    assert torch.equal(grads[0][:, :7], torch.zeros_like(grads[0][:, :7]))  # outside the view
    if dtype == torch.bfloat16:
        assert torch.equal(grads[0], grads[1])
    else:
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-8)


def test_no_grad_path_and_bad_shapes() -> None:
    logits = torch.randn(2, 4, 11)
    targets = torch.randint(0, 11, (2, 4))
    with torch.no_grad():
        assert torch.equal(token_logprobs(logits, targets), _reference(logits, targets, 1.0))
    with pytest.raises(ValueError, match="logits \\[n, t, vocab\\] and targets \\[n, t\\]"):
        token_logprobs(logits, targets[:, :3])
