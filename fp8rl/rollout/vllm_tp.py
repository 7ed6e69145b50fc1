"""Tensor parallelism of vLLM's engine: one rank's part of each HF weight, and whether a model's widths split.

What the weight sync's bit-exact check compares on each rank of a tensor-parallel engine (``fp8rl.rollout.vllm_engine``);
pure functions over tensors and the model's config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from fp8rl.quant import QuantizedTensor
from fp8rl.rollout.vllm_weights import FP8_BLOCK, FUSED_MODULES, VOCAB_PARAMS, model_dims, split_param

# vLLM splits these along their rows (the output: q/k/v and gate/up, column-parallel) or their columns (the input:
# o_proj and down_proj, row-parallel); the vocabulary rows of the embedding and lm_head in blocks of its padded
# vocabulary; norms (and a row-parallel bias, added after the all-reduce) are whole on every rank
COLUMN_PARALLEL = tuple(part for parts in FUSED_MODULES.values() for part in parts)
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def tp_layout_problem(model_config: Mapping[str, Any], tp: int, block_fp8: bool) -> str | None:
    """Why vLLM cannot split this model ``tp`` ways the way ``tp_shard`` reads it back, or None: the attention and
    KV heads and the MLP width divide by ``tp`` (KV heads replicated over ranks are not supported), and under block
    FP8 each rank's part of every linear holds whole 128x128 tiles."""
    if tp == 1:
        return None
    d = model_dims(model_config)
    heads = int(model_config["num_attention_heads"])
    kv_heads = int(model_config.get("num_key_value_heads") or heads)
    for what, n in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv_heads),
        ("intermediate_size", d["inter"]),
    ):
        if n % tp:
            return f"rollout.tensor_parallel_size {tp} does not divide the model's {what} ({n})"
    if block_fp8:
        # split: q/k/v and gate/up by rows, o_proj by its q columns, down_proj by its intermediate columns
        for what, n in (("q", d["q"]), ("k/v", d["kv"]), ("intermediate", d["inter"])):
            if (n // tp) % FP8_BLOCK[0]:
                return (
                    f"rollout.tensor_parallel_size {tp}: each rank would hold {n // tp} {what} rows or columns, not "
                    f"whole {FP8_BLOCK[0]}-wide block-FP8 tiles (use rollout.fp8_scaling 'channel' or a smaller size)"
                )
    return None


def _part(t: torch.Tensor, dim: int, rank: int, tp: int, unit: int = 1) -> torch.Tensor:
    """The ``rank``-th of ``tp`` equal parts of ``t`` along ``dim`` (``unit``: the rows or columns one element of
    ``t`` stands for -- 128 for a block-FP8 scale grid)."""
    size = t.shape[dim] * unit // tp
    return t.narrow(dim, rank * size // unit, -(-size // unit))


def tp_shard(
    name: str, value: torch.Tensor | QuantizedTensor, rank: int, tp: int, vocab_padded: int = 0
) -> torch.Tensor | QuantizedTensor:
    """What rank ``rank`` of a ``tp``-way vLLM engine holds of the HF weight ``name`` (full ``value``), as
    ``unfuse_params`` reads it back: rows of a column-parallel linear (with their scales), columns of a row-parallel
    one (block scales split by tile column; per-channel scales, one per output row, whole), the rank's block of the
    ``vocab_padded`` vocabulary rows (cut to the real ones), everything else whole."""
    if tp == 1:
        return value
    module, _ = split_param(name)
    dim = 0 if module.endswith(COLUMN_PARALLEL) else 1 if module.endswith(ROW_PARALLEL) else None
    if isinstance(value, QuantizedTensor):
        if dim is None:
            raise ValueError(f"{name}: an FP8 weight that is not a decoder linear (vLLM splits only those)")
        data = _part(value.data, dim, rank, tp)
        if value.granularity == "block":
            scale = _part(value.scale_inv, dim, rank, tp, FP8_BLOCK[dim])
        else:  # per-channel [out, 1]: split with the rows, whole with the columns
            scale = _part(value.scale_inv, 0, rank, tp) if dim == 0 else value.scale_inv
        return dataclasses.replace(value, data=data, scale_inv=scale)
    if name in VOCAB_PARAMS:
        if vocab_padded < value.shape[0]:
            raise ValueError(f"{name}: tp_shard needs vLLM's padded vocabulary size, got {vocab_padded}")
        per = vocab_padded // tp
        start, stop = rank * per, min((rank + 1) * per, value.shape[0])
        return value[start : max(start, stop)]
    if dim is None or (dim == 1 and value.dim() == 1):  # whole: norms, a row-parallel bias
        return value
    return _part(value, dim, rank, tp)
