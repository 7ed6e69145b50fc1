"""AdamW over FP32 master weights for a model that computes in BF16.

Replicated (``MasterWeightAdamW``): the model's parameters stay bf16 (the numerics the rollout
engine also runs); each has an fp32 master copy, gradients are accumulated in fp32 across
micro-batches, and after the AdamW step the masters are rounded back into the bf16 parameters.

Sharded (``ShardedAdamW``, with FSDP2): the model's parameters ARE the fp32 masters, each rank
holding 1/world of every one (a ``DTensor`` shard) and AdamW's state for that shard only;
FSDP2 all-gathers them in bf16 for compute and reduce-scatters the bf16 gradients in fp32 into
the sharded fp32 gradients.  Same numerics, 12 bytes per parameter divided by the ranks.

Both give and take their state as full (unsharded) tensors on the CPU in one layout, so a run
checkpointed with one resumes with the other.

Either can keep AdamW's two moments in host memory between steps (``offload_state``, the run config's
``optim.offload_optimizer_state``): after each step they are copied to (pinned) host buffers and their device
storage is released, and the next step copies them back first.  That takes 8 bytes a parameter (divided by the
ranks when sharded) off the GPU while the rollout engine or the next forwards use it, at the cost of the two
copies; the update is the same bytes.  Colocated with vLLM, it is what lets an 8B policy's FSDP2 shards and the
engine share one 80 GB GPU.

On CUDA both use torch's fused AdamW (one kernel reads and writes each tensor once; the default
``foreach`` implementation makes several passes over the fp32 state, 27 ms a step for 0.87B
parameters on an H100): the same update up to floating-point rounding.  On CPU the default
implementation runs, so the CPU tests' numbers do not depend on which one a build has.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

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
        offload_state: bool = False,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.master = [nn.Parameter(p.detach().to(torch.float32).clone()) for p in self.params]
        for m in self.master:
            m.grad = torch.zeros_like(m)
        self.optimizer = _adamw(self.master, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)
        self.offload = StateOffload(self.optimizer) if offload_state else None
        # Data parallelism: sums the accumulated fp32 gradients across ranks before clipping
        # (set by the worker that owns the process group; None in one process).
        self.grad_reducer: Callable[[list[torch.Tensor]], None] | None = None

    def full_state(self) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """(fp32 masters, AdamW state dict) as full tensors (the state copied when it goes back to the host)."""
        masters = [m.detach().clone() for m in self.master]
        if self.offload is None:
            return masters, self.optimizer.state_dict()
        with _on_device(self.offload):
            state = self.optimizer.state_dict()
            return masters, {**state, "state": {i: _cloned(s) for i, s in state["state"].items()}}

    @torch.no_grad()
    def load_full_state(self, masters: list[torch.Tensor], optim_state: dict[str, Any]) -> None:
        _check_count(masters, self.master)
        for m, p, saved in zip(self.master, self.params, masters, strict=True):
            m.copy_(saved)
            p.copy_(saved)
        _load_optimizer_state(self.optimizer, optim_state)
        if self.offload is not None:
            self.offload.replaced()

    @torch.no_grad()
    def accumulate(self) -> None:
        """Move the parameters' (bf16) gradients into the fp32 accumulators (the loss carries any scaling)."""
        for p, m in zip(self.params, self.master, strict=True):
            if p.grad is not None:
                assert m.grad is not None
                m.grad.add_(p.grad)  # fp32 += bf16, promoted in the kernel: no fp32 copy first
                p.grad = None

    @torch.no_grad()
    def step(self, grad_clip: float, grad_scale: float = 1.0) -> float:
        """Scale the summed gradients by ``grad_scale`` (where not 1: a loss whose denominators were known only
        after the backwards), clip, step, copy masters into the model; returns the pre-clip global grad norm."""
        if self.grad_reducer is not None:
            self.grad_reducer([m.grad for m in self.master if m.grad is not None])
        if grad_scale != 1.0:
            torch._foreach_mul_([m.grad for m in self.master if m.grad is not None], grad_scale)
        norm = float(nn.utils.clip_grad_norm_(self.master, grad_clip))
        if math.isfinite(norm):
            with _on_device(self.offload):
                self.optimizer.step()
            torch._foreach_copy_(list[torch.Tensor](self.params), list[torch.Tensor](self.master))
        for m in self.master:
            assert m.grad is not None
            m.grad.zero_()
        return norm


class StateOffload:
    """AdamW's per-parameter state tensors (the two moments; not the step counts) held in host memory between
    steps.  ``to_host`` copies each into a host buffer (pinned for CUDA tensors, allocated once and reused) and
    releases the tensor's device storage in place (its storage resized to 0: the optimizer, and a DTensor around
    it, keep the same tensor objects); ``to_device`` gives the storage back and copies the bytes in.  Nothing may
    read the state while it is on the host (its storage is empty): the optimizers bring it back around their step,
    ``full_state`` and ``load_full_state``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.on_host = False
        self._host: dict[tuple[int, str], torch.Tensor] = {}
        self.seconds = 0.0  # spent copying, both ways, since the last ``take_seconds``

    def take_seconds(self) -> float:
        """The seconds the copies took since the last call (each waits for its copies to land)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def _states(self) -> Iterator[tuple[tuple[int, str], torch.Tensor]]:
        from torch.distributed.tensor import DTensor

        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, value in self.optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        local = value.to_local() if isinstance(value, DTensor) else value
                        yield (id(p), key), local

    @torch.no_grad()
    def to_host(self) -> None:
        if self.on_host:
            return
        t0 = time.perf_counter()
        moved = []
        for key, t in self._states():
            host = self._host.get(key)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
                self._host[key] = host
            host.copy_(t, non_blocking=t.is_cuda)
            moved.append(t)
        if any(t.is_cuda for t in moved):
            torch.cuda.synchronize()  # every copy has landed before the device storage goes
        for t in moved:
            t.untyped_storage().resize_(0)
        self.on_host = True
        self.seconds += time.perf_counter() - t0

    def replaced(self) -> None:
        """The optimizer's state was loaded anew (on its device): send it to the host."""
        self.on_host = False
        self.to_host()

    @torch.no_grad()
    def to_device(self) -> None:
        if not self.on_host:
            return
        t0 = time.perf_counter()
        cuda = False
        for key, t in self._states():
            t.untyped_storage().resize_(t.numel() * t.element_size())
            t.copy_(self._host[key], non_blocking=t.is_cuda)  # ordered before the step on this stream
            cuda = cuda or t.is_cuda
        if cuda:  # the step waits for the copies anyway; waiting here times them
            torch.cuda.synchronize()
        self.on_host = False
        self.seconds += time.perf_counter() - t0


@contextmanager
def _on_device(offload: StateOffload | None) -> Iterator[None]:
    """The optimizer state on its device inside the block, back on the host after (when offloading)."""
    if offload is None:
        yield
        return
    offload.to_device()
    try:
        yield
    finally:
        offload.to_host()


def _cloned(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _adamw(params: list[nn.Parameter], **kwargs: Any) -> torch.optim.AdamW:
    """torch's AdamW, fused where every parameter is on CUDA (see the module docstring)."""
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **kwargs)


def _load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``load_state_dict`` that keeps this optimizer's implementation (fused / foreach): a state saved on a
    GPU resumes on the CPU and back."""
    from torch.distributed.tensor import DTensor

    def plain(v: Any) -> bool:
        return isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.numel() > 0

    given = {v.data_ptr() for s in state["state"].values() for v in s.values() if plain(v)}
    impl = [{k: g.get(k) for k in ("fused", "foreach")} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    # load_state_dict keeps a tensor that is already on the parameter's device and dtype: the optimizer would
    # then update the caller's tensors in place (or offload them); it gets its own copies of those
    for s in optimizer.state.values():
        for k, v in s.items():
            if plain(v) and v.data_ptr() in given:
                s[k] = v.clone()
    for group, own in zip(optimizer.param_groups, impl, strict=True):
        group.update(own)


def _check_count(saved: list[torch.Tensor], own: list[Any]) -> None:
    if len(saved) != len(own):
        raise ValueError(f"trainer state has {len(saved)} master tensors, the model {len(own)}")


def _full(t: torch.Tensor, keep: bool = True) -> torch.Tensor:
    """``t`` whole on the CPU (a DTensor is gathered: a collective); ``keep=False`` joins the gather and drops
    the result (an empty tensor)."""
    from torch.distributed.tensor import DTensor

    whole = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
    return whole.cpu().clone() if keep else torch.empty(0)


def _shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``param`` is (its DTensor shard on its mesh), on its device."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return full.to(param.device)
    return distribute_tensor(full.to(device=param.to_local().device), param.device_mesh, param.placements)


class ShardedAdamW:
    """AdamW over FSDP2-sharded fp32 parameters (the masters themselves); ``MasterWeightAdamW``'s interface."""

    def __init__(
        self,
        params: list[nn.Parameter],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        offload_state: bool = False,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.master = self.params
        self.optimizer = _adamw(self.params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)
        self.offload = StateOffload(self.optimizer) if offload_state else None
        self.grad_reducer: Callable[[list[torch.Tensor]], None] | None = None  # FSDP2 reduce-scatters itself

    def accumulate(self) -> None:
        """Nothing to move: FSDP2 adds each micro-batch's reduce-scattered fp32 gradient to the shard's (a scale
        here would reach the earlier micro-batches' sum too, and race the reduction in flight: the loss carries it)."""

    @torch.no_grad()
    def step(self, grad_clip: float, grad_scale: float = 1.0) -> float:
        """Scale the gradients by ``grad_scale`` (where not 1), clip by the global norm (over all shards), step every
        shard; returns the pre-clip norm."""
        for p in self.params:
            if p.grad is None:  # a parameter no micro-batch reached still takes part in the norm's collectives
                p.grad = torch.zeros_like(p)
            elif grad_scale != 1.0:
                p.grad.mul_(grad_scale)
        norm = nn.utils.clip_grad_norm_(self.params, grad_clip)
        value = float(_full(norm))
        if math.isfinite(value):
            with _on_device(self.offload):
                self.optimizer.step()
        # the sharded fp32 gradients go (4 bytes a parameter over the ranks): the next backward makes new ones
        self.optimizer.zero_grad(set_to_none=True)
        return value

    def full_state(self) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """(fp32 masters, AdamW state dict) as full CPU tensors; a collective: every rank calls it.

        Only rank 0 keeps the copies (the others get ``([], {"state": {}, ...})``): a rank that only joins
        the gathers never holds the whole model's state in host memory."""
        import torch.distributed as dist

        keep = dist.get_rank() == 0
        with _on_device(self.offload):
            state = self.optimizer.state_dict()
            full_state = {
                i: {k: _full(v, keep) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in s.items()}
                for i, s in state["state"].items()
            }
        masters = [_full(p, keep) for p in self.params]
        if not keep:
            return [], {"state": {}, "param_groups": state["param_groups"]}
        return masters, {"state": full_state, "param_groups": state["param_groups"]}

    @torch.no_grad()
    def load_full_state(self, masters: list[torch.Tensor], optim_state: dict[str, Any]) -> None:
        _check_count(masters, self.params)
        for p, saved in zip(self.params, masters, strict=True):
            p.copy_(_shard_like(saved.to(torch.float32), p))
        sharded = {
            i: {
                k: _shard_like(v, self.params[int(i)]) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                for k, v in s.items()
            }
            for i, s in optim_state["state"].items()
        }
        _load_optimizer_state(self.optimizer, {"state": sharded, "param_groups": optim_state["param_groups"]})
        if self.offload is not None:
            self.offload.replaced()


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
