"""FSDP2 for the trainer (``sharding="fsdp"``): the units, the ones held gathered, each micro-batch's flags.

Every decoder layer is a unit and the rest of the model (embeddings, final norm, lm_head) the root unit, over the
default process group.  The parameters become the fp32 masters, sharded; compute is bf16 and the gradients are
reduce-scattered in fp32 and SUMMED (no division: each rank's loss is its exact share of the global loss, as the
replicated ranks' gradients are summed).

Held units.  ``fp8_gather_once``: a layer's FP8 linears quantize their gathered weights once per weight version
and cache the copies (``FP8TrainLinear.cache_until_changed``), so the bf16 weights FSDP2 would gather again for
every later forward and backward (every micro-batch's) go unread.  Such a layer is left unsharded after its
forward and backward (its gradients still reduce-scatter every micro-batch), its FP8 linears free the gathered
bf16 weights once quantized (``release_weight``: only the norms and any BF16 linear stay gathered), and
``reshard_held`` puts it back so that the next forward gathers the new weights.  The root unit is held the same
way in every precision: FSDP2 keeps it gathered from a forward through its backward; held after the backward too,
the next micro-batch's forward starts without an all-gather, which would queue behind the previous backward's
reduce-scatters on the one NCCL stream (2 bytes a parameter of the embeddings and lm_head on every rank until the
weights change).

Micro-batches (``before_backward``).  Only a step's last backward makes the compute stream wait for the pending
reduce-scatters (``set_is_last_backward``; FSDP2 otherwise waits at the end of every backward, so the next
micro-batch's forward waited for the whole queue).  ``reduce_grads_once``: only the last reduce-scatters; the
earlier ones add their gradients to FSDP2's unsharded fp32 accumulators (``set_requires_gradient_sync``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fp8rl.train.fp8_linear import FP8TrainLinear


class FSDPUnits:
    """``fully_shard`` applied to a causal LM with decoder layers at ``model.model.layers``."""

    def __init__(self, model: nn.Module, device: torch.device, gather_once: bool) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():
            raise ValueError("trainer sharding 'fsdp' needs a process group (the Ray trainer workers make one)")
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)  # a bare "cuda" has no index; set_device needs one
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        with torch.no_grad():
            for p in model.parameters():  # bf16 -> fp32 is exact: the masters start where the weights are
                p.data = p.data.to(torch.float32)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        units: list[Any] = []
        self.held: list[Any] = []  # left unsharded between weight versions (the module docstring)
        layers: Any = model.model.layers  # type: ignore[union-attr]
        for layer in layers:  # per layer: a BF16 layer (bf16_first/last_layers) keeps FSDP2's default
            fp8 = [m for m in layer.modules() if isinstance(m, FP8TrainLinear)]
            once = gather_once and bool(fp8)
            unit = fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=not once)
            units.append(unit)
            if once:
                unit.set_reshard_after_backward(False, recurse=False)
                self.held.append(unit)
                for m in fp8:
                    m.release_weight = True
        self.root: Any = fully_shard(model, mesh=mesh, mp_policy=mp)
        self.root.set_reshard_after_backward(False, recurse=False)
        self.held.append(self.root)
        units.append(self.root)
        for unit in units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)

    def reshard_held(self) -> None:
        """Put the held units back to their shards (the next forward gathers again): before new weights, and before
        anything reads the parameters outside a forward (a held layer's module attributes are the gathered
        parameters, whose FP8 linears' storage is released)."""
        for unit in self.held:
            unit.reshard()

    def before_backward(self, index: int, count: int, reduce_grads_once: bool) -> None:
        """Tell FSDP2 whether micro-batch ``index`` of ``count`` ends the step (the module docstring)."""
        last = index == count - 1
        self.root.set_is_last_backward(last)
        if reduce_grads_once:
            self.root.set_requires_gradient_sync(last)
