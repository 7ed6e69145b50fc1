"""The row recipe's fused FP8 linear (``fp8rl.quant.row_linear``) on a Hopper GPU, against the torch reference.

Its quantizations must be the reference's bytes and scales (``quantize_activation`` / ``quantize_weight`` with
``granularity='row'`` of X, dY, their transposes, W and W.T), the padding rows zeros; the input's copies are shared
between the linears that read one tensor; activation checkpointing changes no bit.  That the linear computes the
reference linear's function: ``tests/gpu/test_quant_kernels.py`` (both recipes).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs a Hopper GPU (torch's row-wise scaled GEMM is sm_90)", allow_module_level=True)
pytest.importorskip("triton")

from fp8rl.quant import QuantSpec, quantize_activation, quantize_weight  # noqa: E402
from fp8rl.quant.formats import get_format  # noqa: E402
from fp8rl.quant.row_linear import (  # noqa: E402
    padded_tokens,
    quantize_row_input,
    quantize_row_weight,
    quantize_rows_cols,
)
from fp8rl.train.fp8_linear import FP8TrainLinear  # noqa: E402

ROW = QuantSpec(granularity="row")


def _input(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda") * torch.logspace(-4, 3, k, device="cuda")
    x = x.bfloat16()
    x[0, 0] = 0.0
    if k > 3:
        x[:, 3] = 0.0  # an all-zero column
    return x


def _equal_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize(("m", "k"), [(1, 64), (100, 96), (1000, 3000), (4096, 512), (300, 4096), (40, 20000)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
def test_row_and_column_copies_equal_the_reference_of_x_and_x_transposed(m: int, k: int, fmt: str, pow2: bool) -> None:
    """Every way the row path quantizes an input: the row copy alone (one pass; two passes past its width limit),
    both copies from one cast pass, the transposed copy alone; padded to 16 rows with zeros."""
    x = _input(m, k, m + k)
    spec = QuantSpec(granularity="row", fmt=fmt, pow2_scales=pow2)
    mp = padded_tokens(m)
    ref, ref_t = quantize_activation(x, spec, backend="torch"), quantize_activation(x.t(), spec, backend="torch")
    for rowwise, colwise in [(True, False), (True, True), (False, True)]:
        q, s, qt, st = quantize_row_input(x, spec, rowwise=rowwise, colwise=colwise)
        assert (q is not None) == rowwise and (qt is not None) == colwise
        if q is not None and s is not None:
            assert q.shape == (mp, k) and _equal_bytes(q[:m], ref.data) and torch.equal(s[:m], ref.scale_inv)
            assert not q[m:].view(torch.uint8).any()  # zero padding rows
        if qt is not None and st is not None:
            assert qt.shape == (k, mp) and _equal_bytes(qt[:, :m], ref_t.data) and torch.equal(st, ref_t.scale_inv)
            assert not qt[:, m:].view(torch.uint8).any()
    q2, s2, _, _ = quantize_rows_cols(x, get_format(fmt), pow2, mp, rowwise=True, colwise=False)  # two-pass rows
    assert q2 is not None and s2 is not None
    assert _equal_bytes(q2[:m], ref.data) and torch.equal(s2[:m], ref.scale_inv)


def test_copies_of_a_non_contiguous_input() -> None:
    x = _input(512, 768, 1)[:, ::2]  # column stride 2
    q, s, qt, st = quantize_rows_cols(x, get_format("e4m3"), False, rowwise=True, colwise=True)
    assert q is not None and s is not None and qt is not None and st is not None
    ref, ref_t = quantize_activation(x, ROW, backend="torch"), quantize_activation(x.t(), ROW, backend="torch")
    assert _equal_bytes(q, ref.data) and torch.equal(s, ref.scale_inv)
    assert _equal_bytes(qt, ref_t.data) and torch.equal(st, ref_t.scale_inv)
    one, one_s, _, _ = quantize_row_input(x, ROW)  # the one-pass kernel
    assert one is not None and one_s is not None
    assert _equal_bytes(one, ref.data) and torch.equal(one_s, ref.scale_inv)


def test_row_weight_is_the_reference_of_w_and_w_transposed_and_requantizes_in_place() -> None:
    w = _input(640, 384, 2)
    rw = quantize_row_weight(w, ROW)
    ref, ref_t = quantize_weight(w, ROW, backend="torch"), quantize_weight(w.t(), ROW, backend="torch")
    assert _equal_bytes(rw.q, ref.data) and torch.equal(rw.scale, ref.scale_inv)
    assert _equal_bytes(rw.qt, ref_t.data) and torch.equal(rw.scale_t, ref_t.scale_inv)
    ptrs = [t.data_ptr() for t in (rw.q, rw.scale, rw.qt, rw.scale_t)]
    again = quantize_row_weight(w * -3, ROW, into=rw)
    assert [t.data_ptr() for t in (again.q, again.scale, again.qt, again.scale_t)] == ptrs
    ref, ref_t = quantize_weight(w * -3, ROW, backend="torch"), quantize_weight((w * -3).t(), ROW, backend="torch")
    assert _equal_bytes(again.q, ref.data) and torch.equal(again.scale, ref.scale_inv)
    assert _equal_bytes(again.qt, ref_t.data) and torch.equal(again.scale_t, ref_t.scale_inv)
    with pytest.raises(ValueError, match="cannot requantize"):
        quantize_row_weight(w[:, :128], ROW, into=rw)


def test_row_linears_reading_one_input_share_its_copies_and_checkpointing_changes_no_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """q/k/v-style linears on one tensor quantize it once; under ``checkpoint_contexts`` the first forward makes the
    row copy alone and the recompute both; outputs and gradients equal those of separate inputs and of no
    checkpointing, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    from fp8rl.train import fp8_linear
    from fp8rl.train.fp8_linear import checkpoint_contexts

    torch.manual_seed(0)
    lins = [
        FP8TrainLinear.from_linear(torch.nn.Linear(512, n, bias=False, device="cuda", dtype=torch.bfloat16), ROW)
        for n in (512, 128, 128)
    ]
    base = torch.randn(2, 300, 512, device="cuda", dtype=torch.bfloat16)
    g = [torch.randn(2, 300, lin.out_features, device="cuda", dtype=torch.bfloat16) for lin in lins]
    calls: list[tuple[bool, bool]] = []
    real = fp8_linear.quantize_row_input
    monkeypatch.setattr(
        fp8_linear, "quantize_row_input", lambda *a, **k: calls.append((k["rowwise"], k["colwise"])) or real(*a, **k)
    )

    def run(mode: str) -> list[torch.Tensor]:
        for lin in lins:
            lin.weight.grad = None
        x = base.clone().requires_grad_(True)

        def region(inp: torch.Tensor) -> list[torch.Tensor]:
            h = inp * 1
            inputs = [inp * 1 for _ in lins] if mode == "separate" else [h] * len(lins)
            return [lin(i) for lin, i in zip(lins, inputs, strict=True)]

        ys = checkpoint(region, x, use_reentrant=False, context_fn=checkpoint_contexts) if mode == "checkpoint" else (
            region(x))  # fmt: skip
        torch.autograd.backward(ys, g)
        return [y.detach() for y in ys] + [lin.weight.grad for lin in lins] + [x.grad]

    separate = run("separate")
    assert calls == [(True, True)] * 3 + [(True, True)] * 3  # each input, then each dY
    calls.clear()
    shared = run("shared")
    assert calls == [(True, True)] + [(True, True)] * 3  # the input once
    calls.clear()
    checkpointed = run("checkpoint")
    assert calls[0] == (True, False) and calls[1] == (True, True)  # first forward: no transposed copy; recompute
    for a, b, c in zip(shared[:-1], separate[:-1], checkpointed[:-1], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(shared[-1], checkpointed[-1])
    # dX: the same three products, summed by autograd in an order that may differ
    assert ((shared[-1] - separate[-1]).float().norm() / separate[-1].float().norm()).item() < 1e-2


def test_row_weight_is_quantized_once_per_weight_version() -> None:
    lin = FP8TrainLinear.from_linear(torch.nn.Linear(256, 256, device="cuda", dtype=torch.bfloat16), ROW)
    first = lin._fused_operands()
    assert first is not None and lin._fused_operands() is first
    with torch.no_grad():
        lin.weight.add_(1.0)
    second = lin._fused_operands()
    assert second is not None and second is not first
    assert _equal_bytes(second.q, quantize_weight(lin.weight, ROW).data)
    with torch.no_grad():
        lin.weight.mul_(-2.0)
    lin.refresh_weight()  # in place (CUDA graphs): the same buffers, the new weight's bytes
    third = lin._fused_operands()
    assert (
        third is not None and third.q.data_ptr() == second.q.data_ptr() and third.qt.data_ptr() == second.qt.data_ptr()
    )
    assert _equal_bytes(third.q, quantize_weight(lin.weight, ROW).data)
    assert _equal_bytes(third.qt, quantize_weight(lin.weight.t(), ROW).data)
