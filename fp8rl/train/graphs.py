"""CUDA graphs of the decoder layers (``optim.cuda_graphs``): a replay per layer instead of its launches.

At RL shapes (hidden 2048, a few thousand tokens a micro-batch) a decoder layer is host-bound: the FP8
linear spends ~1 ms of host time per forward + backward (Python, Triton's launcher, cuBLASLt) against less
device work, and an H100 measured FP8's train phase at 0.6x BF16 at Llama-3.2-1B width for that reason
(docs/benchmarks.md).  A captured layer replays its kernels with one launch, so the step is bounded by
the device again, in every precision.

How it works (``LayerGraphs``):

- The trainer pads each micro-batch to a shape bucket (``TorchTrainer``): its width rounded up to a
  multiple of ``optim.cuda_graph_width`` columns and its rows to what the token budget gives at that
  width, so a step sees few shapes.
- When a shape seen before (in any forward) comes with gradients on, every decoder layer is captured for it by
  ``torch.cuda.make_graphed_callables`` (a forward and a backward graph each, one memory pool per shape);
  from then on the layer's forward replays them.  The logprob forwards (no gradients) replay the same
  forward graphs.  A shape seen once runs eagerly.
- At most ``optim.cuda_graph_shapes`` shapes are kept; capturing another drops the least recently used
  one (its graphs and their memory).
- The optimizer updates the bf16 weights in place and the FP8 linears requantize their cached operands
  in place (``FP8TrainLinear.refresh_weight``), so the graphs read the current weights.

Cost: per captured shape, the activations one micro-batch keeps for its backward and one bf16 copy of the
decoder's gradients (the backward graph's outputs) stay allocated.  Numerics: a replay runs the kernels
the capture recorded, so a padded micro-batch gives the same results as the eager trainer on the same
padded shape (``tests/gpu/test_cuda_graphs_trainer.py``); the padding itself is pad tokens outside the
loss, which under FP8 join the token groups of the wgrad quantization as padding already did.

Limits: a CUDA device, ``trainer: torch``, no FSDP sharding, no activation checkpointing (each refused by
the trainer with the option's name).  A layer called with a KV cache or with extra tensor arguments runs
eagerly, and so does every forward outside the trainer's own (``enabled``), e.g. the KV-cache calibration,
whose hooks would not run inside a replay.
"""

from __future__ import annotations

import gc
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

ShapeKey = tuple[Any, ...]


class _LayerCall(nn.Module):
    """``layer(h, attention_mask=mask, position_embeddings=(cos, sin))`` with positional tensors only, as
    ``make_graphed_callables`` takes them; the layer's parameters are this module's (same objects)."""

    def __init__(self, layer: nn.Module, forward: Callable[..., Any], masked: bool) -> None:
        super().__init__()
        self.layer = layer
        self._layer_forward = forward  # the layer's own forward, not the dispatching one LayerGraphs installs
        self.masked = masked

    def forward(self, h: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        mask, cos, sin = rest if self.masked else (None, *rest)
        out = self._layer_forward(h, attention_mask=mask, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out


class LayerGraphs:
    """Captured forward/backward graphs of ``layers`` per micro-batch shape (see the module docstring)."""

    def __init__(self, layers: nn.ModuleList, max_shapes: int, prepare: Callable[[], None]) -> None:
        if max_shapes < 1:
            raise ValueError(f"optim.cuda_graph_shapes must be >= 1, got {max_shapes}")
        self.layers = list(layers)
        self.max_shapes = max_shapes
        self.prepare = prepare  # before a capture: whatever the layers cache lazily (FP8 weight operands)
        self.enabled = False  # replays only inside the trainer's own forwards (``active``)
        self.captures = 0
        self.replays = 0  # micro-batch forwards that replayed the graphs
        self.eager = 0  # micro-batch forwards that ran eagerly while enabled
        self.capture_s = 0.0
        self._graphs: OrderedDict[ShapeKey, list[nn.Module]] = OrderedDict()
        self._seen: Counter[ShapeKey] = Counter()
        self._current: tuple[ShapeKey, list[nn.Module]] | None = None
        self._forwards = [layer.forward for layer in self.layers]
        for i, layer in enumerate(self.layers):
            layer.forward = partial(self._forward, i)  # an instance attribute: names and parameters unchanged

    @property
    def shapes(self) -> list[ShapeKey]:
        """The captured shapes, least recently used first."""
        return list(self._graphs)

    def active(self) -> _Active:
        return _Active(self)

    @staticmethod
    def _key(h: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor) -> ShapeKey:
        m = None if mask is None else (tuple(mask.shape), mask.dtype)
        return tuple(h.shape), h.dtype, m, tuple(cos.shape), cos.dtype

    def _forward(
        self,
        i: int,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> Any:
        graphed = None
        if (
            self.enabled
            and position_embeddings is not None
            and past_key_values is None
            and not use_cache
            and (attention_mask is None or isinstance(attention_mask, torch.Tensor))
            and not any(isinstance(v, torch.Tensor) for v in kwargs.values())
        ):
            graphed = self._select(i, hidden_states, attention_mask, position_embeddings)
        if graphed is None:
            return self._forwards[i](
                hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=past_key_values, use_cache=use_cache, position_embeddings=position_embeddings,
                **kwargs,
            )  # fmt: skip
        assert position_embeddings is not None  # graphed implies it
        cos, sin = position_embeddings
        args = (hidden_states, attention_mask, cos, sin) if attention_mask is not None else (hidden_states, cos, sin)
        return graphed[i](*args)

    def _select(
        self, i: int, h: torch.Tensor, mask: torch.Tensor | None, pe: tuple[torch.Tensor, torch.Tensor]
    ) -> list[nn.Module] | None:
        """The graphs this layer replays for this forward; decided (and captured) at the first layer."""
        if not h.is_cuda:
            return None
        key = self._key(h, mask, pe[0])
        if i > 0:
            return self._current[1] if self._current is not None and self._current[0] == key else None
        graphs = self._graphs.get(key)
        if graphs is not None:
            self._graphs.move_to_end(key)
        elif self._seen[key] >= 1 and torch.is_grad_enabled() and h.requires_grad:
            graphs = self._capture(key, h, mask, pe)
        else:
            self._seen[key] += 1
        self._current = (key, graphs) if graphs is not None else None
        if graphs is None:
            self.eager += 1
        else:
            self.replays += 1
        return graphs

    def _capture(
        self, key: ShapeKey, h: torch.Tensor, mask: torch.Tensor | None, pe: tuple[torch.Tensor, torch.Tensor]
    ) -> list[nn.Module]:
        while len(self._graphs) >= self.max_shapes:
            self._graphs.popitem(last=False)  # its graphs and memory pool go with the last reference
        self._current = None
        t0 = time.perf_counter()
        self.prepare()
        # Whatever is garbage is freed now, not by a collection inside the capture (a CUDA graph destroyed while
        # another is captured fails the capture), and what the eager forwards cached on this stream is handed
        # back: the capture's pool and the warm-up's side stream cannot use it.
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        masked = mask is not None
        calls = tuple(_LayerCall(layer, fwd, masked) for layer, fwd in zip(self.layers, self._forwards, strict=True))

        def sample() -> tuple[torch.Tensor, ...]:  # the real inputs' values: a realistic warm-up
            rest = ((mask.clone(),) if mask is not None else ()) + tuple(t.detach().clone() for t in pe)
            return (h.detach().clone().requires_grad_(True), *rest)

        collecting = gc.isenabled()
        gc.disable()
        try:
            graphed = torch.cuda.make_graphed_callables(calls, tuple(sample() for _ in calls), num_warmup_iters=2)
        finally:
            if collecting:
                gc.enable()
        torch.cuda.empty_cache()  # what the warm-up cached on its side stream
        self._graphs[key] = [g for g in graphed if isinstance(g, nn.Module)]  # modules in, modules out
        self.captures += 1
        dt = time.perf_counter() - t0
        self.capture_s += dt
        print(
            f"[trainer] CUDA graphs captured for micro-batch shape {list(h.shape[:2])} ({len(calls)} layers) "
            f"in {dt:.1f} s",
            file=sys.stderr,
        )
        return self._graphs[key]

    def stats(self) -> dict[str, float]:
        return {"cuda_graph_captures": float(self.captures), "cuda_graph_replays": float(self.replays),
                "cuda_graph_eager": float(self.eager), "cuda_graph_capture_s": self.capture_s}  # fmt: skip


class _Active:
    def __init__(self, graphs: LayerGraphs) -> None:
        self.graphs = graphs

    def __enter__(self) -> None:
        self.graphs.enabled = True

    def __exit__(self, *exc: object) -> None:
        self.graphs.enabled = False
        self.graphs._current = None
