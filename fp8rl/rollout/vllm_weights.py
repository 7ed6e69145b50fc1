"""What the vLLM engine serves and how its weights are named: checkpoints and HF <-> vLLM names.  Pure.

Checkpoints.  FP8 recipes serve a block-FP8 checkpoint (``weight`` float8_e4m3fn [out, in]
and ``weight_scale_inv`` float32 [ceil(out/128), ceil(in/128)]: DeepSeek style,
``fp8rl.quant``'s ``block`` granularity) or, for ``row`` granularity (``rollout.fp8_scaling:
channel``), a per-channel one (compressed-tensors: ``weight`` [out, in] and ``weight_scale``
float32 [out, 1], activations scaled per token by vLLM; vLLM holds such a weight transposed,
[in, out] over the same bytes, which ``row_major`` undoes).  ``serving_checkpoint`` takes an fp8rl FP8
checkpoint as it is (after checking it was made with the recipe's options) or converts a
BF16 one with ``fp8rl.checkpoint.convert_checkpoint`` into the work dir, once per source
and recipe; the ``bf16`` recipe serves the BF16 checkpoint.  vLLM's block-FP8 loader needs
whole 128x128 tiles in every part of a fused module, so the consumer policy of the converter
applies (``partial_tiles="keep"``): a linear that is not whole tiles, and the modules vLLM
fuses it with, stay in BF16 as ``ignored_layers``.  ``fp8_module_names_from_config`` reads
them back from the checkpoint, so the engine holds, and the sync sends, exactly those in BF16;
``partial_tile_note`` is the line the engine prints about them.

Names.  vLLM fuses q/k/v into ``self_attn.qkv_proj`` and gate/up into ``mlp.gate_up_proj``
(rows stacked in that order, dim 0) and pads the vocabulary rows of the embedding and
lm_head.  ``fused_layout`` says where each HF module's rows sit; ``unfuse_params`` reads
vLLM's parameters back under HF names (views, for the bit-exact sync check), and
``order_by_fused_module`` groups a reload payload so the parts of a fused module arrive together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp8rl.atomic import OutputExistsError
from fp8rl.checkpoint.convert import not_converted_modules
from fp8rl.checkpoint.formats import read_granularity
from fp8rl.config import Recipe, vllm_recipe_problem
from fp8rl.errors import UserError
from fp8rl.models.layers import DECODER_LINEAR_SUFFIXES, kept_layers
from fp8rl.models.loading import read_model_config
from fp8rl.quant import E4M3, QuantizedTensor
from fp8rl.rollout.vllm_patches import VLLMPatchError

FP8_BLOCK = (128, 128)
SCALE_SUFFIX = {"block": "weight_scale_inv", "row": "weight_scale"}  # a weight's scales, by granularity
# vLLM module -> the HF modules fused into it, in vLLM's row order
FUSED_MODULES = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")  # vLLM pads their rows to a multiple of 64

Weights = dict[str, torch.Tensor | QuantizedTensor]


# ---- configuration and checkpoints (pure) ------------------------------------------------------------
def check_recipe_supported(recipe: Recipe) -> None:
    """vLLM serves bf16, block FP8 with 128x128 weight tiles and 1x128 activation groups, and per-channel
    (``row``) FP8 with per-token activations; anything else is a ``UserError`` naming the field."""
    problem = vllm_recipe_problem(recipe)
    if problem:
        raise UserError(problem)


def model_dims(model_config: Mapping[str, Any]) -> dict[str, int]:
    """Row counts of the decoder linears from an HF config: q, kv (each of k and v), inter, hidden, layers."""
    hidden, heads = int(model_config["hidden_size"]), int(model_config["num_attention_heads"])
    head_dim = int(model_config.get("head_dim") or hidden // heads)
    kv_heads = int(model_config.get("num_key_value_heads") or heads)
    return {
        "q": heads * head_dim,
        "kv": kv_heads * head_dim,
        "inter": int(model_config["intermediate_size"]),
        "hidden": hidden,
        "layers": int(model_config["num_hidden_layers"]),
        "vocab": int(model_config["vocab_size"]),
    }


def fp8_module_names_from_config(model_config: Mapping[str, Any], recipe: Recipe) -> list[str]:
    """HF names of the decoder linears the engine holds in FP8: none for a bf16 rollout; for a BF16 config the
    recipe's layers, for a quantized one (a serving checkpoint) those not in its ``ignored_layers``."""
    if recipe.rollout_precision != "fp8":
        return []
    n = int(model_config["num_hidden_layers"])
    kept = kept_layers(n, recipe.quant.bf16_first_layers, recipe.quant.bf16_last_layers)
    ignored = set(_ignored_layers(model_config.get("quantization_config") or {}))
    names = [f"model.layers.{i}.{s}" for i in range(n) if i not in kept for s in DECODER_LINEAR_SUFFIXES]
    return [m for m in names if m not in ignored]


def _ignored_layers(qcfg: Mapping[str, Any]) -> list[str]:
    # block ("fp8"): ignored_layers / modules_to_not_convert; per-channel (compressed-tensors): ignore
    return list(qcfg.get("ignored_layers") or qcfg.get("modules_to_not_convert") or qcfg.get("ignore") or [])


def partial_tile_modules_of(model_dir: Path, recipe: Recipe) -> dict[str, dict[str, Any]]:
    """The converter's partial-tile policy applied to the checkpoint at ``model_dir`` (its headers only)."""
    from fp8rl.checkpoint.convert import ConvertOptions, partial_tile_modules, read_headers
    from fp8rl.checkpoint.shards import shard_layout

    cfg = read_model_config(model_dir)
    headers = read_headers(model_dir, shard_layout(model_dir).files)
    opts = ConvertOptions(recipe.quant)  # partial tiles kept, as vLLM loads them
    kept = opts.kept_layers(int(cfg["num_hidden_layers"]))
    return partial_tile_modules({name: shape for name, (_, shape) in headers.items()}, opts, kept)


def expected_ignored_layers(model_dir: Path, model_config: Mapping[str, Any], recipe: Recipe) -> set[str]:
    """The modules an FP8 checkpoint for ``recipe`` keeps in BF16 (``fp8rl convert``'s list): the recipe's BF16
    layers and the linears that are not whole tiles (with their fused partners)."""
    n = int(model_config["num_hidden_layers"])
    kept = kept_layers(n, recipe.quant.bf16_first_layers, recipe.quant.bf16_last_layers)
    return set(not_converted_modules(kept)) | set(partial_tile_modules_of(model_dir, recipe))


def check_fp8_checkpoint(model_dir: Path, model_config: Mapping[str, Any], recipe: Recipe) -> None:
    """An existing FP8 checkpoint must have been made with the served recipe's granularity and BF16 layers."""
    qcfg = model_config["quantization_config"]
    try:
        granularity, block = read_granularity(qcfg)
    except (ValueError, KeyError) as e:
        raise UserError(f"{model_dir / 'config.json'}: quantization_config is not an fp8rl layout: {e}") from None
    q = recipe.quant
    want = f"block {list(q.weight_block)}" if q.granularity == "block" else q.granularity
    if granularity != q.granularity or (granularity == "block" and block != tuple(q.weight_block)):
        have = f"{granularity} {list(block)}" if granularity == "block" else granularity
        raise UserError(
            f"{model_dir}: checkpoint is FP8 {have}, but the engine serves recipe {recipe.name!r} as FP8 {want} "
            "(recipe.quant.granularity, or 'row' under rollout.fp8_scaling 'channel'); pass the BF16 checkpoint, "
            "or set rollout.fp8_scaling to match the checkpoint"
        )
    ignored = set(_ignored_layers(qcfg))
    expected = expected_ignored_layers(model_dir, model_config, recipe)
    if ignored != expected:
        raise UserError(
            f"{model_dir}: the checkpoint keeps {sorted(ignored - {'lm_head'})} in BF16, but "
            f"recipe.quant.bf16_first_layers {q.bf16_first_layers} / bf16_last_layers {q.bf16_last_layers} "
            f"(and the modules that are not whole tiles) ask for {sorted(expected - {'lm_head'})}; convert the "
            "BF16 checkpoint with the recipe's options"
        )


def partial_tile_note(checkpoint: Path, fp8_modules: list[str], recipe: Recipe) -> str | None:
    """What the engine says when the consumer policy kept linears of an FP8 recipe in BF16 (None if none)."""
    if recipe.rollout_precision != "fp8":
        return None
    report = checkpoint / "fp8rl_conversion_report.json"
    partial = partial_tile_modules_of(checkpoint, recipe)
    if not partial:
        return None
    where = f" (reasons in {report})" if report.is_file() else ""
    return (
        f"vLLM serves {len(partial)} decoder linears in BF16 because they (or a module vLLM fuses them with) are "
        f"not whole {recipe.quant.weight_block[0]}x{recipe.quant.weight_block[1]} tiles{where}; "
        f"{len(fp8_modules)} are FP8. The sync sends those {len(partial)} in BF16."
    )


def conversion_key(model_dir: Path, recipe: Recipe) -> str:
    """A cache key for the converted checkpoint: source path, weight files' sizes and mtimes, recipe options."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".json"))
    meta = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    blob = json.dumps([str(model_dir.resolve()), meta, recipe.quant.model_dump(mode="json")], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def serving_checkpoint(model_dir: str | os.PathLike[str], recipe: Recipe, work_dir: str | os.PathLike[str]) -> Path:
    """The directory vLLM loads for ``recipe``: the BF16 checkpoint, an FP8 checkpoint given as is
    (checked against the recipe), or ``<work_dir>/vllm-checkpoints/<name>-fp8-<key>`` converted from BF16."""
    src = Path(model_dir)
    cfg = read_model_config(src)
    quantized = "quantization_config" in cfg
    if recipe.rollout_precision != "fp8":
        if quantized:
            raise UserError(
                f"{src}: recipe {recipe.name!r} rolls out in bf16 but the checkpoint is quantized "
                f"({cfg['quantization_config'].get('quant_method')!r}); pass the BF16 checkpoint"
            )
        return src
    check_recipe_supported(recipe)
    if quantized:
        check_fp8_checkpoint(src, cfg, recipe)
        return src
    dst = Path(work_dir) / "vllm-checkpoints" / f"{src.name}-fp8-{conversion_key(src, recipe)}"
    if not (dst / "config.json").is_file():
        from fp8rl.checkpoint.convert import ConvertOptions, convert_checkpoint

        # check_recipe_supported pinned the recipe to 128x128 block or per-channel scaling (and fmt is e4m3 only),
        # so the recipe's options are the ones vLLM loads
        try:
            # partial tiles may leave few linears FP8: the engine says how many, and a run refuses none
            # (fp8rl.fp8_coverage), so the conversion's own coverage check is not asked for here
            convert_checkpoint(src, dst, ConvertOptions(recipe.quant), show_progress=False, allow_unquantized=True)
        except (OutputExistsError, OSError):
            if not (dst / "config.json").is_file():  # not another worker that finished first
                raise
    return dst


# ---- weight naming: HF names <-> vLLM's fused parameters (pure) ---------------------------------------
@dataclass(frozen=True)
class FusedSlice:
    """HF module ``rows`` rows starting at ``start`` of the vLLM module ``target`` (dim 0)."""

    target: str
    start: int
    rows: int


def fused_layout(model_config: Mapping[str, Any], tp: int = 1) -> dict[str, FusedSlice]:
    """HF module name -> its rows in vLLM's ``qkv_proj`` / ``gate_up_proj`` (q, k, v; gate, up); with tensor
    parallelism, in one rank's part of them (each part's rows divided by ``tp``: ``tp_layout_problem``)."""
    d = model_dims(model_config)
    q, kv, inter = d["q"] // tp, d["kv"] // tp, d["inter"] // tp
    sizes = {"self_attn.qkv_proj": (q, kv, kv), "mlp.gate_up_proj": (inter, inter)}
    out = {}
    for i in range(d["layers"]):
        for fused, parts in FUSED_MODULES.items():
            start = 0
            for part, rows in zip(parts, sizes[fused], strict=True):
                out[f"model.layers.{i}.{part}"] = FusedSlice(f"model.layers.{i}.{fused}", start, rows)
                start += rows
    return out


def split_param(name: str) -> tuple[str, str]:
    """``model.layers.0.mlp.up_proj.weight_scale_inv`` -> (``model.layers.0.mlp.up_proj``, ``weight_scale_inv``)."""
    module, _, suffix = name.rpartition(".")
    return module, suffix


def parts_by_target(layout: Mapping[str, FusedSlice]) -> dict[str, list[tuple[str, FusedSlice]]]:
    """vLLM fused module -> its HF parts with their slices, in row order."""
    out: dict[str, list[tuple[str, FusedSlice]]] = {}
    for hf_module, s in layout.items():
        out.setdefault(s.target, []).append((hf_module, s))
    return out


def _rows(tensor: torch.Tensor, suffix: str, s: FusedSlice) -> torch.Tensor:
    if suffix == "weight_scale_inv":
        b = FP8_BLOCK[0]
        return tensor[s.start // b : -(-(s.start + s.rows) // b)]
    return tensor[s.start : s.start + s.rows]  # weights, and per-channel scales (a row each)


def row_major(tensor: torch.Tensor) -> torch.Tensor:
    """A 2-D FP8 weight vLLM holds transposed (its per-channel CUTLASS GEMM reads ``weight.t()`` of the
    loaded [out, in] bytes: shape [in, out], strides (1, in)) as the [out, in] view; anything else as is."""
    if (
        tensor.dtype == torch.float8_e4m3fn
        and tensor.dim() == 2
        and tensor.shape[0] > 1
        and tensor.stride() == (1, tensor.shape[0])
    ):
        return tensor.t()
    return tensor


def per_channel_layout_problem(params: Mapping[str, torch.Tensor]) -> str | None:
    """Why vLLM's raw parameters are not the per-channel layout ``row_major`` reads back (every FP8 weight the
    transposed view of [out, in] bytes), or None.  A contiguous [in, out] copy of a square weight would pass
    every shape check and differ only at the first verify; this catches it at start."""
    for name, p in params.items():
        if p.dtype == torch.float8_e4m3fn and name.endswith(".weight") and row_major(p) is p:
            return (
                f"{name}: vLLM holds this per-channel FP8 weight as {tuple(p.shape)} with strides {p.stride()}, "
                "not the transposed view of [out, in] fp8rl reads back; vLLM's per-channel layout moved"
            )
    return None


def unfuse_params(
    params: Mapping[str, torch.Tensor], layout: Mapping[str, FusedSlice], vocab_size: int, tp_rank: int = 0
) -> Weights:
    """vLLM's parameters -> HF names; FP8 weights with their scales as ``QuantizedTensor``: block scaling's
    ``weight_scale_inv`` tiles, or per-channel ``weight_scale`` rows (as ``[out, 1]``).

    Returns views of ``params`` (no copies), FP8 weights as [out, in] (``row_major``).  Vocabulary rows vLLM
    pads are cut to ``vocab_size``.  With tensor parallelism (``layout`` of ``fused_layout(..., tp)``), rank
    ``tp_rank``'s parts: what ``tp_shard`` cuts from the full weights (its vocabulary rows are the
    ``tp_rank``-th block of the padded vocabulary, of which those below ``vocab_size`` are kept).
    """
    by_target = parts_by_target(layout)
    flat: dict[str, torch.Tensor] = {}
    for name, held in params.items():
        tensor = row_major(held)
        module, suffix = split_param(name)
        if module in by_target:
            for hf_module, s in by_target[module]:
                flat[f"{hf_module}.{suffix}"] = _rows(tensor, suffix, s)
        else:
            flat[name] = tensor[: _vocab_rows(vocab_size, tensor.shape[0], tp_rank)] if name in VOCAB_PARAMS else tensor
    out: Weights = {}
    for name, tensor in flat.items():
        module, suffix = split_param(name)
        if suffix in SCALE_SUFFIX.values():
            continue
        out[name] = _quantized(name, tensor, flat) if suffix == "weight" and tensor.dtype == E4M3.dtype else tensor
    return out


def _vocab_rows(vocab_size: int, local_rows: int, tp_rank: int) -> int:
    """How many of a rank's ``local_rows`` (a block of vLLM's padded vocabulary) are real vocabulary rows."""
    return max(0, min(vocab_size - tp_rank * local_rows, local_rows))


def _quantized(name: str, data: torch.Tensor, flat: Mapping[str, torch.Tensor]) -> QuantizedTensor:
    """The FP8 weight ``name`` with the scales vLLM holds beside it, by their name (``SCALE_SUFFIX``)."""
    module, _ = split_param(name)
    for granularity, suffix in SCALE_SUFFIX.items():
        scale = flat.get(f"{module}.{suffix}")
        if scale is None:
            continue
        if granularity == "block":
            return QuantizedTensor(data, scale, "block", E4M3, FP8_BLOCK)
        if scale.numel() != data.shape[0]:
            raise VLLMPatchError(
                f"{module}.{suffix}: {tuple(scale.shape)} is not one scale per row of {name} {tuple(data.shape)}; "
                "vLLM's per-channel layout moved"
            )
        return QuantizedTensor(data, scale.reshape(-1, 1), "row", E4M3)
    raise VLLMPatchError(f"{name} is FP8 but vLLM holds no {module}.weight_scale_inv or .weight_scale")


def checkpoint_items(weights: Mapping[str, torch.Tensor | QuantizedTensor]) -> list[tuple[str, torch.Tensor]]:
    """HF-named weights as the (name, tensor) pairs of an FP8 checkpoint: beside each FP8 weight its
    ``.weight_scale_inv`` (block) or ``.weight_scale`` (per-channel, compressed-tensors)."""
    items = []
    for name, value in weights.items():
        if isinstance(value, QuantizedTensor):
            if value.granularity not in SCALE_SUFFIX:
                raise ValueError(f"{name}: vLLM loads block or per-channel FP8, not {value.granularity!r} scaling")
            module, _ = split_param(name)
            items += [(name, value.data), (f"{module}.{SCALE_SUFFIX[value.granularity]}", value.scale_inv)]
        else:
            items.append((name, value))
    return items


def order_by_fused_module(
    names: Iterable[str], layout: Mapping[str, FusedSlice]
) -> tuple[list[str], dict[str, list[str]]]:
    """``names`` grouped so the parts of one fused module are adjacent (vLLM processes a layer once all
    its parts arrived); also the fused modules touched -> their HF parts missing from ``names``."""
    groups: dict[str, list[str]] = {}
    present: dict[str, set[str]] = {}
    for name in names:
        module, _ = split_param(name)
        s = layout.get(module)
        key = s.target if s is not None else name
        groups.setdefault(key, []).append(name)
        if s is not None:
            present.setdefault(s.target, set()).add(module)
    missing = {}
    parts = parts_by_target(layout)
    for target, have in present.items():
        lack = [m for m, _ in parts[target] if m not in have]
        if lack:
            missing[target] = lack
    return [n for group in groups.values() for n in group], missing


def reload_items(
    payload: Mapping[str, torch.Tensor | QuantizedTensor],
    held: Mapping[str, torch.Tensor | QuantizedTensor],
    layout: Mapping[str, FusedSlice],
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs to hand vLLM's ``reload_weights`` for ``payload`` (HF names, all or a subset).

    The parts of each fused module come side by side; the parts a partial payload lacks are
    taken from ``held`` (what vLLM holds now, under HF names) as copies, since the reload
    writes into the very tensors ``held`` views.
    """
    full: dict[str, torch.Tensor | QuantizedTensor] = dict(payload)
    _, missing = order_by_fused_module(payload, layout)
    lacking = {module for parts in missing.values() for module in parts}
    for name, value in held.items():
        if split_param(name)[0] in lacking:
            full[name] = (
                dataclasses.replace(value, data=value.data.clone(), scale_inv=value.scale_inv.clone())
                if isinstance(value, QuantizedTensor)
                else value.clone()
            )
    names, _ = order_by_fused_module(full, layout)
    return checkpoint_items({n: full[n] for n in names})
