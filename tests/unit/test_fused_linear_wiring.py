"""The fused FP8 linear's autograd wiring on the CPU (``fp8rl.train.fp8_linear._FusedFP8LinearFunction``).

The recipe ops here are the reference quantizers and the emulated GEMM, so the function must give the reference
linear's outputs and gradients bit for bit; under ``checkpoint_contexts`` a layer's first forward makes no transposed
copy and saves placeholders, the recompute makes them, and nothing changes.  What the real ops compute (the Triton
kernels, the cuBLAS GEMMs, padding) is checked on a GPU (``tests/gpu/test_quant_kernels.py``,
``tests/gpu/test_row_linear_cuda.py``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from fp8rl.quant import QuantizedTensor, QuantSpec, fp8_gemm, quantize_activation, quantize_weight
from fp8rl.quant.formats import get_format
from fp8rl.train.fp8_linear import _FP8LinearFunction, _FusedFP8LinearFunction, checkpoint_contexts


class EmulatedOps:
    """A recipe's ops (as ``BlockOps`` / ``RowOps``) from the torch reference, recording what each call made."""

    def __init__(self, spec: QuantSpec) -> None:
        self.spec, self.calls = spec, list[tuple[str, bool, bool]]()
        self.act_block = (1, spec.act_block) if spec.granularity == "block" else None

    def _copies(self, x2: torch.Tensor, rowwise: bool, colwise: bool) -> tuple[torch.Tensor | None, ...]:
        a = quantize_activation(x2, self.spec, backend="torch") if rowwise else None
        t = quantize_activation(x2.t(), self.spec, backend="torch") if colwise else None
        return (a.data if a else None, a.scale_inv if a else None, t.data if t else None, t.scale_inv if t else None)

    def input(
        self, x: torch.Tensor, spec: QuantSpec, colwise: bool, wgrad_rows: bool
    ) -> tuple[torch.Tensor | None, ...]:
        self.calls.append(("input", True, colwise))
        return self._copies(x.reshape(-1, x.shape[-1]), True, colwise)

    def grad(self, g2: torch.Tensor, spec: QuantSpec, rowwise: bool, colwise: bool) -> tuple[torch.Tensor | None, ...]:
        self.calls.append(("grad", rowwise, colwise))
        return self._copies(g2, rowwise, colwise)

    def placeholders(self, k: int, m: int, spec: QuantSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        groups = 1 if spec.granularity == "row" else -(-m // spec.act_block)
        return (
            torch.empty((), dtype=get_format(spec.fmt).dtype, device=device).expand(k, m),
            torch.empty((), dtype=torch.float32, device=device).expand(k, groups),
        )

    def _q(self, data: torch.Tensor, scale: torch.Tensor) -> QuantizedTensor:
        return QuantizedTensor(data, scale, self.spec.granularity, get_format(self.spec.fmt), self.act_block)

    def forward_mm(self, xq: torch.Tensor, xs: torch.Tensor, wq: SimpleNamespace, m: int) -> torch.Tensor:
        return fp8_gemm(self._q(xq, xs), wq.w, backend="emulated")

    def dgrad_mm(self, gq: torch.Tensor, gs: torch.Tensor, wq: SimpleNamespace, m: int) -> torch.Tensor:
        return fp8_gemm(self._q(gq, gs), wq.wt, backend="emulated")

    def wgrad_mm(self, gqt: torch.Tensor, gst: torch.Tensor, xqt: torch.Tensor, xst: torch.Tensor) -> torch.Tensor:
        return fp8_gemm(self._q(gqt, gst), self._q(xqt, xst), backend="emulated")


@pytest.mark.parametrize("granularity", ["row", "block"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_function_with_reference_ops_is_the_reference_linear_with_and_without_checkpointing(
    granularity: str, bias: bool
) -> None:
    torch.manual_seed(0)
    spec = QuantSpec(granularity=granularity)  # type: ignore[arg-type]
    lin = torch.nn.Linear(256, 384, bias=bias, dtype=torch.bfloat16)
    w = lin.weight.detach()
    wq = SimpleNamespace(
        q=w, w=quantize_weight(w, spec, backend="torch"), wt=quantize_weight(w.t(), spec, backend="torch")
    )
    base = torch.randn(2, 150, 256, dtype=torch.bfloat16)
    g = torch.randn(2, 150, 384, dtype=torch.bfloat16)
    ops = EmulatedOps(spec)

    def run(mode: str) -> list[torch.Tensor]:
        lin.weight.grad = None
        if lin.bias is not None:
            lin.bias.grad = None
        x = base.clone().requires_grad_(True)

        def region(inp: torch.Tensor) -> torch.Tensor:
            h = inp * 1
            if mode == "reference":
                return _FP8LinearFunction.apply(h, lin.weight, lin.bias, spec)
            return _FusedFP8LinearFunction.apply(h, lin.weight, lin.bias, wq, spec, True, ops)

        y = checkpoint(region, x, use_reentrant=False, context_fn=checkpoint_contexts) if mode == "checkpoint" else (
            region(x))  # fmt: skip
        y.backward(g)
        assert x.grad is not None and lin.weight.grad is not None
        return [y.detach(), x.grad, lin.weight.grad] + ([lin.bias.grad] if lin.bias is not None else [])

    ref = run("reference")
    fused = run("fused")
    assert ops.calls == [("input", True, True), ("grad", True, True)]
    ops.calls.clear()
    checkpointed = run("checkpoint")
    # the first forward: no transposed copy (placeholders saved); the recompute makes it; then dY's copies
    assert ops.calls == [("input", True, False), ("input", True, True), ("grad", True, True)]
    for a, b, c in zip(fused, ref, checkpointed, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_placeholder_reaching_the_backward_is_refused() -> None:
    """A checkpointed first forward whose recompute never ran (reentrant checkpointing would do that) must not
    produce a weight gradient from the stand-in."""
    from fp8rl.train import fp8_linear

    spec = QuantSpec(granularity="row")
    lin = torch.nn.Linear(128, 64, bias=False, dtype=torch.bfloat16)
    w = lin.weight.detach()
    wq = SimpleNamespace(q=w, w=quantize_weight(w, spec), wt=quantize_weight(w.t(), spec))
    x = torch.randn(10, 128, dtype=torch.bfloat16, requires_grad=True)
    with fp8_linear._saves_discarded(True):
        y = _FusedFP8LinearFunction.apply(x, lin.weight, None, wq, spec, True, EmulatedOps(spec))
    with pytest.raises(RuntimeError, match="placeholder reached the backward"):
        y.sum().backward()


def test_only_a_bias_training_quantizes_no_gradient() -> None:
    """Input and weight frozen, the bias trained: the backward asks the ops for no copy of dY (a launch without
    outputs would write into the gradient the bias's is summed from)."""
    spec = QuantSpec(granularity="row")
    lin = torch.nn.Linear(128, 64, dtype=torch.bfloat16)
    lin.weight.requires_grad_(False)
    w = lin.weight.detach()
    wq = SimpleNamespace(q=w, w=quantize_weight(w, spec), wt=quantize_weight(w.t(), spec))
    ops = EmulatedOps(spec)
    x = torch.randn(10, 128, dtype=torch.bfloat16)
    g = torch.randn(10, 64, dtype=torch.bfloat16)
    _FusedFP8LinearFunction.apply(x, lin.weight, lin.bias, wq, spec, False, ops).backward(g)
    assert ops.calls == [("input", True, False)]
    assert lin.bias.grad is not None and torch.equal(lin.bias.grad, g.sum(0))
