"""The torch-native FP8 linear for training: forward, dgrad and wgrad GEMMs all in FP8.

Per the block recipe (DeepSeek-V3, TransformerEngine ``Float8BlockScaling``), every GEMM
quantizes each operand along its own reduction dimension:

    forward  Y[M,N]  = X[M,K]  @ W[N,K]^T   X: 1x128 groups along K, W: 128x128 tiles
    dgrad    dX[M,K] = dY[M,N] @ W^T[K,N]^T dY: 1x128 along N,       W^T: 128x128 tiles
    wgrad    dW[N,K] = dY^T[N,M] @ X^T[K,M]^T  dY^T and X^T: 1x128 along M (tokens)

All of it goes through ``fp8rl.quant``, so a weight quantizes to the same bytes here as in the
rollout engine and in the converted checkpoint.  Two paths compute the same FP8 operands:

- fused (CUDA, Hopper, block recipe, K and N multiples of 128; ``fp8rl.quant.block_linear``):
  one Triton pass over X gives its 1x128 copy for the forward and its transposed copy for the
  wgrad (kept for the backward instead of X), and linears that read the same X one after the other
  (q/k/v, gate/up) share that pass (``_SharedInput``); one pass over dY gives both of its copies; the
  weight and its transpose are quantized once per weight version (once per optimizer step, not
  per micro-batch; under FSDP2, once per ``weights_changed`` call) and cached on the module; the GEMMs are cuBLAS block-scaled GEMMs.
  Under activation checkpointing (``checkpoint_contexts``) a layer's first forward makes no transposed copy of X:
  what it saves is dropped, and the recompute before the backward makes the copy the wgrad reads.
- fused row (CUDA, Hopper, row recipe, K and N multiples of 16; ``fp8rl.quant.row_linear``): a scale per token and
  per channel, row-scaled GEMMs, otherwise as the block path (the input's copies shared, the transposed one kept
  for the backward and made only in the recompute under checkpointing, the weight's two copies cached per version).
- reference (everything else, the CPU): the torch quantizers and ``fp8_gemm`` (tensor cores
  where cuBLAS takes the operands, exact emulation on CPU).

The module holds the weight in the model's dtype (bf16); master weights live in the optimizer
(``fp8rl.train.optim``).  The cached FP8 weight and its transpose cost 2 bytes per parameter.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fp8rl.quant import QuantizedTensor, QuantSpec, fp8_gemm, quantize_activation, quantize_weight
from fp8rl.quant.block_linear import (
    BlockWeight,
    block_input_rows,
    block_linear_supported,
    block_mm,
    block_wgrad,
    quantize_block_input,
    quantize_block_weight,
)
from fp8rl.quant.formats import get_format
from fp8rl.quant.row_linear import (
    RowWeight,
    padded_tokens,
    quantize_row_input,
    quantize_row_weight,
    row_linear_supported,
    row_mm,
)


class _CheckpointState(threading.local):
    discarded = False  # inside the first forward of a checkpointed region: what autograd saves there is dropped


_checkpoint_state = _CheckpointState()


@contextmanager
def _saves_discarded(discarded: bool) -> Iterator[None]:
    before = _checkpoint_state.discarded
    _checkpoint_state.discarded = discarded
    try:
        yield
    finally:
        _checkpoint_state.discarded = before


def checkpoint_contexts() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """``context_fn`` for non-reentrant ``torch.utils.checkpoint``: (the first forward's, the recompute's).

    Non-reentrant checkpointing runs a region's first forward with gradients on and keeps only the metadata of
    what it saves; the recompute in the backward saves the tensors the backward reads.  In the first forward
    the fused FP8 linear therefore skips the transposed (wgrad) copy of its input and saves placeholders of
    the same shape, dtype and device (stride-0 views, no memory), which the checkpoint's determinism check
    compares against the recompute's real copies.  The forward output is computed exactly as in the recompute.
    The recompute clears the flag itself rather than inherit the thread's (a backward run from inside another
    region's first forward must still save real copies).
    """
    return _saves_discarded(True), _saves_discarded(False)


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        spec: QuantSpec,
        cached: tuple[QuantizedTensor, QuantizedTensor] | None = None,  # quantize_weight of W and of W^T
    ) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        wq = cached[0] if cached is not None else quantize_weight(weight, spec)
        out = fp8_gemm(quantize_activation(x2, spec), wq, out_dtype=x.dtype, bias=bias)
        # with the weight's FP8 copies cached, its values are never read again (their storage may be released)
        ctx.save_for_backward(x2, None if cached is not None else weight)
        ctx.spec, ctx.cached, ctx.weight_dtype = spec, cached, weight.dtype
        ctx.has_bias = bias is not None
        return out.reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        spec: QuantSpec = ctx.spec
        cached: tuple[QuantizedTensor, QuantizedTensor] | None = ctx.cached
        wtq = cached[1] if cached is not None else quantize_weight(weight.t(), spec)
        n = wtq.data.shape[1]
        g2 = grad_out.reshape(-1, n)
        grad_x = fp8_gemm(quantize_activation(g2, spec), wtq, out_dtype=grad_out.dtype).reshape(
            *grad_out.shape[:-1], x2.shape[1]
        )
        grad_w = fp8_gemm(
            quantize_activation(g2.t(), spec), quantize_activation(x2.t(), spec), out_dtype=torch.float32
        ).to(ctx.weight_dtype)
        grad_b = g2.sum(0).to(ctx.weight_dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


class _SharedInput:
    """The FP8 copies of the last input the fused path quantized, for the next linear that reads the same tensor.

    HF decoders feed one normalized hidden state to q_proj, k_proj and v_proj (and one to gate_proj and
    up_proj), each a separate linear: without this, each would quantize it again (same bytes).  The entry is
    valid while that very tensor object is alive and unmodified (identity through a weak reference, its
    version counter) and the cached copies cover what the caller needs; it drops itself when the tensor is
    freed, so it never keeps FP8 copies alive past the activation they came from.
    """

    def __init__(self) -> None:
        self._ref: weakref.ref[torch.Tensor] | None = None
        self._key: tuple[Any, ...] = ()
        self._value: tuple[torch.Tensor | None, ...] = ()

    def _clear(self, ref: object) -> None:
        if ref is self._ref:  # not an older entry's reference dying after a newer one replaced it
            self._ref, self._key, self._value = None, (), ()

    def get(self, x: torch.Tensor, key: object, colwise: bool) -> tuple[torch.Tensor | None, ...] | None:
        if self._ref is None or self._ref() is not x or self._key != (x._version, key):
            return None
        if colwise and self._value[2] is None:
            return None
        return self._value

    def put(self, x: torch.Tensor, key: object, value: tuple[torch.Tensor | None, ...]) -> None:
        self._ref = weakref.ref(x, self._clear)
        self._key, self._value = (x._version, key), value


_shared_input = _SharedInput()


def _shared_copies(
    x: torch.Tensor, spec: QuantSpec, rows: int, colwise: bool, make: Callable[[torch.Tensor], tuple[Any, ...]]
) -> tuple[torch.Tensor | None, ...]:
    """``make(x viewed as [M, K])`` (its ``(q, s, qt, st)`` padded to ``rows`` rows), shared with the previous linear
    when it read ``x`` with the same recipe and padding (the same GEMM shapes)."""
    cached = _shared_input.get(x, (spec, rows), colwise)
    if cached is None:
        cached = make(x.reshape(-1, x.shape[-1]))
        _shared_input.put(x, (spec, rows), cached)
    return cached


def _quantize_input(
    x: torch.Tensor, spec: QuantSpec, colwise: bool, wgrad_rows: bool
) -> tuple[torch.Tensor | None, ...]:
    """``quantize_block_input`` of ``x`` viewed as ``[M, K]``, shared with the previous linear when it read ``x``.

    ``wgrad_rows``: pad the rows as the transposed copy needs even without it (a checkpointed first forward), so
    its GEMM runs on the same operand shape as the recompute's."""
    rows = block_input_rows(x.numel() // x.shape[-1], colwise or wgrad_rows)
    return _shared_copies(
        x, spec, rows, colwise,
        lambda x2: quantize_block_input(x2, spec, rowwise=True, colwise=colwise, wgrad_rows=wgrad_rows),
    )  # fmt: skip


def _placeholders(k: int, m: int, spec: QuantSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stride-0 stand-ins with the shapes, dtypes and device of ``quantize_block_input``'s transposed copy of an
    ``[m, k]`` input and its scales (what a checkpointed first forward saves; the recompute saves the real ones)."""
    mp = block_input_rows(m, wgrad=True)
    fp8 = get_format(spec.fmt).dtype
    return (
        torch.empty((), dtype=fp8, device=device).expand(k, mp),
        torch.empty((), dtype=torch.float32, device=device).expand(k, -(-mp // 128)),
    )


class BlockOps:
    """The block recipe's operands and GEMMs for ``_FusedFP8LinearFunction`` (``fp8rl.quant.block_linear``).

    An ops class gives: ``input`` (an input's ``(q, s, qt, st)``, shared between linears that read it; ``qt`` only
    with ``colwise``), ``grad`` (dY's copies), ``placeholders`` (stride-0 stand-ins shaped as ``input``'s ``qt, st``),
    ``forward_mm`` / ``dgrad_mm`` (with the weight operands) and ``wgrad_mm``.  The methods look this module's
    names up when called (tests wrap them)."""

    @staticmethod
    def input(x: torch.Tensor, spec: QuantSpec, colwise: bool, wgrad_rows: bool) -> tuple[torch.Tensor | None, ...]:
        return _quantize_input(x, spec, colwise=colwise, wgrad_rows=wgrad_rows)

    @staticmethod
    def grad(g2: torch.Tensor, spec: QuantSpec, rowwise: bool, colwise: bool) -> tuple[torch.Tensor | None, ...]:
        return quantize_block_input(g2, spec, rowwise=rowwise, colwise=colwise)

    @staticmethod
    def placeholders(k: int, m: int, spec: QuantSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return _placeholders(k, m, spec, device)

    @staticmethod
    def forward_mm(xq: torch.Tensor, xs: torch.Tensor, wq: Any, m: int) -> torch.Tensor:
        return block_mm(xq, xs, wq.q, wq.scale_cublas, m)

    @staticmethod
    def dgrad_mm(gq: torch.Tensor, gs: torch.Tensor, wq: Any, m: int) -> torch.Tensor:
        assert wq.qt is not None and wq.scale_t_cublas is not None
        return block_mm(gq, gs, wq.qt, wq.scale_t_cublas, m)

    @staticmethod
    def wgrad_mm(gqt: torch.Tensor, gst: torch.Tensor, xqt: torch.Tensor, xst: torch.Tensor) -> torch.Tensor:
        return block_wgrad(gqt, gst, xqt, xst)


class RowOps:
    """The row recipe's (``fp8rl.quant.row_linear``), as ``BlockOps``: tokens padded to 16 either way."""

    @staticmethod
    def input(x: torch.Tensor, spec: QuantSpec, colwise: bool, wgrad_rows: bool) -> tuple[torch.Tensor | None, ...]:
        rows = padded_tokens(x.numel() // x.shape[-1])
        return _shared_copies(
            x, spec, rows, colwise, lambda x2: quantize_row_input(x2, spec, rowwise=True, colwise=colwise)
        )

    @staticmethod
    def grad(g2: torch.Tensor, spec: QuantSpec, rowwise: bool, colwise: bool) -> tuple[torch.Tensor | None, ...]:
        return quantize_row_input(g2, spec, rowwise=rowwise, colwise=colwise)

    @staticmethod
    def placeholders(k: int, m: int, spec: QuantSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        fp8 = get_format(spec.fmt).dtype
        return (
            torch.empty((), dtype=fp8, device=device).expand(k, padded_tokens(m)),
            torch.empty((), dtype=torch.float32, device=device).expand(k, 1),
        )

    @staticmethod
    def forward_mm(xq: torch.Tensor, xs: torch.Tensor, wq: Any, m: int) -> torch.Tensor:
        return row_mm(xq, xs, wq.q, wq.scale, m)

    @staticmethod
    def dgrad_mm(gq: torch.Tensor, gs: torch.Tensor, wq: Any, m: int) -> torch.Tensor:
        return row_mm(gq, gs, wq.qt, wq.scale_t, m)

    @staticmethod
    def wgrad_mm(gqt: torch.Tensor, gst: torch.Tensor, xqt: torch.Tensor, xst: torch.Tensor) -> torch.Tensor:
        return row_mm(gqt, gst, xqt, xst, gqt.shape[0])


class _FusedFP8LinearFunction(torch.autograd.Function):
    """The fused path (see the module docstring); ``ops`` (``BlockOps``, ``RowOps``) is the recipe's operands and
    GEMMs, ``wq`` its weight operands (``q [N, K]`` and ``qt``), quantized before."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        wq: Any,
        spec: QuantSpec,
        need_wgrad: bool,  # decided by the caller: grad mode is always off inside forward
        ops: Any,
    ) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        m = x.numel() // k
        discarded = need_wgrad and _checkpoint_state.discarded  # saved tensors dropped: no transposed copy
        xq, xs, xqt, xst = ops.input(x, spec, colwise=need_wgrad and not discarded, wgrad_rows=need_wgrad)
        assert xq is not None and xs is not None
        out = ops.forward_mm(xq, xs, wq, m)
        if bias is not None:
            out = out + bias.to(out.dtype)
        if discarded:
            xqt, xst = ops.placeholders(k, m, spec, x.device)
        ctx.save_for_backward(xqt, xst)
        ctx.wq, ctx.spec, ctx.m, ctx.has_bias, ctx.ops = wq, spec, m, bias is not None, ops
        ctx.weight_dtype = weight.dtype
        return out.to(x.dtype).reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xqt, xst = ctx.saved_tensors
        n, k = ctx.wq.q.shape
        g2 = grad_out.reshape(-1, n)
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # nothing to quantize when only a bias trains (a launch without outputs would write into g2)
        gq = gs = gqt = gst = None
        if need_dgrad or need_wgrad:
            gq, gs, gqt, gst = ctx.ops.grad(g2, ctx.spec, rowwise=need_dgrad, colwise=need_wgrad)
        grad_x = grad_w = grad_b = None
        if need_dgrad:
            assert gq is not None and gs is not None
            grad_x = ctx.ops.dgrad_mm(gq, gs, ctx.wq, ctx.m).to(grad_out.dtype).reshape(*grad_out.shape[:-1], k)
        if need_wgrad:
            assert gqt is not None and gst is not None and xqt is not None
            if xqt.stride(-1) == 0:  # the real copies are contiguous; a placeholder here would be a wrong gradient
                raise RuntimeError(
                    "a checkpointed first forward's FP8 placeholder reached the backward (the recompute did not "
                    "replace it): fp8rl.train.fp8_linear.checkpoint_contexts needs non-reentrant torch.utils.checkpoint"
                )
            grad_w = ctx.ops.wgrad_mm(gqt, gst, xqt, xst).to(ctx.weight_dtype)
        if ctx.has_bias:
            grad_b = g2.sum(0).to(ctx.weight_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


class FP8TrainLinear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run in FP8 per ``spec``; parameters unchanged (same names)."""

    # the fused path's FP8 weight operands (block or row recipe), per weight version
    _fused_weight: BlockWeight | RowWeight | None = None
    # the reference path's (quantize_weight of W, of W^T), kept only when the gathered weight is released
    _reference_weight: tuple[QuantizedTensor, QuantizedTensor] | None = None
    # FSDP2 re-gathers the weight into the same storage every forward (its version counter says nothing):
    # the sharded trainer sets this and calls ``weights_changed`` after every optimizer step instead
    cache_until_changed: bool = False
    # with cache_until_changed: once its FP8 copies are made, free the (gathered) weight's storage -- nothing reads
    # it again before ``weights_changed``; the sharded trainer's ``optim.fp8_gather_once`` (FSDP2 then keeps the
    # layer "unsharded" across micro-batches without holding its bf16 weights, and gathers once per weight version)
    release_weight: bool = False

    def __init__(self, in_features: int, out_features: int, bias: bool, spec: QuantSpec, **kw: Any) -> None:
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.spec = spec

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: QuantSpec) -> FP8TrainLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias  # share the Parameters
        new.spec = spec
        new._fused_weight = None
        new._reference_weight = None
        return new

    def _fused_operands(self) -> BlockWeight | RowWeight | None:
        """The weight's fused-path operands (block or row recipe), re-quantized only when the weight changed (its
        version counter); None where this linear takes the reference path."""
        w = self.weight
        block = block_linear_supported(self.in_features, self.out_features, self.spec, w.device)
        if not block and not row_linear_supported(self.in_features, self.out_features, self.spec, w.device):
            return None
        cached: BlockWeight | RowWeight | None = getattr(self, "_fused_weight", None)
        stale = cached is None or (not self.cache_until_changed and cached.key != (w.data_ptr(), w._version))
        if stale:
            with torch.no_grad():
                if block:
                    cached = quantize_block_weight(w.detach(), self.spec, transpose=True)
                else:
                    cached = quantize_row_weight(w.detach(), self.spec)
            self._fused_weight = cached
        return cached

    def _reference_operands(self) -> tuple[QuantizedTensor, QuantizedTensor] | None:
        """The reference path's FP8 copies of W and W^T, cached until ``weights_changed`` -- only where the gathered
        weight is released after this forward (``release_weight``): 2 bytes a parameter, as the fused path's cache."""
        if not (self.release_weight and self.cache_until_changed):
            return None
        if self._reference_weight is None:
            with torch.no_grad():
                w = self.weight.detach()
                self._reference_weight = (quantize_weight(w, self.spec), quantize_weight(w.t(), self.spec))
        return self._reference_weight

    def _release(self) -> None:
        """Free the weight's storage (``release_weight``): FSDP2 allocates it again at its next all-gather.
        Only a gathered (plain) weight: a forward that somehow ran on the sharded parameter (a DTensor, the fp32
        master shard) must never lose it."""
        if isinstance(self.weight, DTensor):
            return
        storage = self.weight.untyped_storage()
        if storage.size():
            storage.resize_(0)

    def weights_changed(self) -> None:
        """The weight was updated (an optimizer step, a load): the next forward re-quantizes it."""
        self._fused_weight = None
        self._reference_weight = None

    def refresh_weight(self) -> None:
        """The weight was updated and CUDA graphs read this module's cached FP8 operands
        (``fp8rl.train.graphs``): requantize into the same buffers now (nothing cached: nothing to do)."""
        cached = self._fused_weight
        with torch.no_grad():
            if isinstance(cached, BlockWeight):
                self._fused_weight = quantize_block_weight(self.weight.detach(), self.spec, True, into=cached)
            elif isinstance(cached, RowWeight):
                self._fused_weight = quantize_row_weight(self.weight.detach(), self.spec, into=cached)

    def prepare(self) -> None:
        """Quantize the weight now if the fused path will need it (before a CUDA graph capture)."""
        self._fused_operands()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        wq = self._fused_operands()
        if wq is not None:
            need_wgrad = torch.is_grad_enabled() and self.weight.requires_grad
            ops = BlockOps if isinstance(wq, BlockWeight) else RowOps
            out = _FusedFP8LinearFunction.apply(x, self.weight, self.bias, wq, self.spec, need_wgrad, ops)
        else:
            out = _FP8LinearFunction.apply(x, self.weight, self.bias, self.spec, self._reference_operands())
        if self.release_weight and self.cache_until_changed:
            self._release()
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.spec.granularity}"
