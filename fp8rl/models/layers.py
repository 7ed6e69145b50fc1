"""Which linear layers a recipe puts in FP8: the decoder blocks' projections, minus configured BF16 layers."""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

# Decoder linear layers of the Qwen2/Qwen3/Llama/Gemma 3 families (HF names); everything else
# (embeddings, lm_head, norms, attention math) stays in high precision.
DECODER_LINEAR = re.compile(
    r"^(?P<module>model\.layers\.(?P<layer>\d+)\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj))\.weight$"
)
DECODER_LINEAR_SUFFIXES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def kept_layers(num_layers: int, bf16_first: int, bf16_last: int) -> set[int]:
    """Decoder layer indices that stay in high precision (first N and last N)."""
    first = set(range(min(bf16_first, num_layers)))
    last = set(range(max(num_layers - bf16_last, 0), num_layers))
    return first | last


def fp8_module_names(model: nn.Module, bf16_first: int = 0, bf16_last: int = 0) -> list[str]:
    """Names of the ``nn.Linear`` modules to run in FP8 (HF module names, without ``.weight``)."""
    num_layers = int(getattr(model, "config").num_hidden_layers)  # noqa: B009
    kept = kept_layers(num_layers, bf16_first, bf16_last)
    names = []
    for name, module in model.named_modules():
        m = DECODER_LINEAR.match(name + ".weight")
        if m and isinstance(module, nn.Linear) and int(m["layer"]) not in kept:
            names.append(name)
    return names


def gemm_gflop(linear: nn.Linear, tokens: int) -> float:
    """The forward GEMM of ``linear`` over ``tokens`` rows, in GFLOP: 2 x tokens x in_features x out_features."""
    return 2 * tokens * linear.in_features * linear.out_features / 1e9


def drop_small_gemms(model: nn.Module, names: list[str], tokens: int, min_gflop: float) -> list[str]:
    """``names`` less the linears whose forward GEMM over ``tokens`` rows is under ``min_gflop`` GFLOP (those train
    in BF16: ``OptimConfig.fp8_min_gemm_gflop``); all of them where ``min_gflop`` is 0."""
    if min_gflop <= 0:
        return names
    kept = []
    for name in names:
        linear = model.get_submodule(name)
        if isinstance(linear, nn.Linear) and gemm_gflop(linear, tokens) >= min_gflop:
            kept.append(name)
    return kept


def swap_modules(model: nn.Module, names: list[str], make: Callable[[str, nn.Module], nn.Module]) -> None:
    """Replace each named submodule by ``make(name, old)`` in place."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, make(name, getattr(parent, child)))
