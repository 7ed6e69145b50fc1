"""HF safetensors checkpoint -> FP8 checkpoint (and back), streamed shard by shard.

Only the linear layers of decoder blocks are quantized (``fp8rl.models.layers.DECODER_LINEAR``);
embeddings, lm_head, norms, biases and the configured BF16 layers keep their
dtype.

Partial tiles (``partial_tiles``).  The consumers of a block-FP8 checkpoint -- transformers'
FP8 loader and vLLM -- need every quantized weight to be whole ``weight_block`` tiles
(transformers: "Weight shape (192, 576) not divisible by scale grid"; vLLM: each part of a
fused qkv / gate_up).  By default (``"keep"``) a decoder linear whose shape is not a multiple
of the block in both dimensions keeps its source dtype, and so do the other parts of the module
vLLM fuses it into (q/k/v, gate/up: vLLM refuses a fused module with some parts quantized); each
is named in the config's ``modules_to_not_convert`` and listed, with the reason, in the
conversion report.  The decision is made from the shard headers, before any tensor is read.
``"quantize"`` quantizes it anyway with ceil-div tiles (fp8rl's own engines read that; the
consumers above do not).  One input shard is held in memory at a time, so peak memory follows the
largest shard, not the model.  The destination is written to a temporary
directory and renamed when complete.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

import fp8rl
from fp8rl.atomic import atomic_directory
from fp8rl.checkpoint.formats import quantization_config, scale_name
from fp8rl.checkpoint.report import ConversionReport, TensorReport
from fp8rl.checkpoint.shards import (
    INDEX_NAME,
    CheckpointError,
    ShardLayout,
    copy_side_files,
    sha256_file,
    shard_layout,
    tree_digest,
    write_index,
)
from fp8rl.config.recipe import QuantConfig
from fp8rl.models.layers import DECODER_LINEAR, DECODER_LINEAR_SUFFIXES, kept_layers
from fp8rl.models.loading import read_model_config
from fp8rl.quant import QuantSpec, quantize_weight

SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MANIFEST_NAME = "fp8rl_manifest.json"
REPORT_JSON = "fp8rl_conversion_report.json"
REPORT_MD = "fp8rl_conversion_report.md"


# the settings of ``QuantConfig`` a checkpoint holds, in the order its report and manifest record them; act_block is
# how an engine groups activations at run time, not part of the weights
RECORDED_QUANT_FIELDS = ("granularity", "pow2_scales", "bf16_first_layers", "bf16_last_layers", "weight_block", "fmt")


@dataclass(frozen=True)
class ConvertOptions:
    """What :func:`convert_checkpoint` produces: a recipe's ``quant`` (the one source of the scaling settings:
    ``ConvertOptions(recipe.quant)`` is the checkpoint a recipe rolls out from) and the converter's own
    ``partial_tiles`` policy (module docstring)."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    partial_tiles: str = "keep"  # keep | quantize: ``keep`` is what vLLM and transformers load

    def spec(self) -> QuantSpec:
        """The weights' ``QuantSpec``: the recipe's, with the default activation group (a checkpoint holds weights,
        and its manifest records the spec they were quantized with)."""
        return dataclasses.replace(self.quant.spec(), act_block=QuantSpec.act_block)

    def record(self) -> dict[str, Any]:
        """The options as the conversion report and manifest record them (``RECORDED_QUANT_FIELDS``, partial_tiles)."""
        quant = self.quant.model_dump()
        return {**{name: quant[name] for name in RECORDED_QUANT_FIELDS}, "partial_tiles": self.partial_tiles}

    def kept_layers(self, num_layers: int) -> set[int]:
        """Decoder layer indices that stay in their original precision."""
        return kept_layers(num_layers, self.quant.bf16_first_layers, self.quant.bf16_last_layers)


@dataclass
class _Progress:
    bar: Any
    tensors: list[TensorReport] = field(default_factory=list)


PARTIAL_TILES = ("keep", "quantize")


# the HF modules vLLM fuses into one parameter (``qkv_proj``, ``gate_up_proj``): quantized together or not at all
FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def partial_tile_reason(shape: tuple[int, ...], opts: ConvertOptions) -> str | None:
    """Why a weight of ``shape`` is not whole ``opts.quant.weight_block`` tiles (block granularity), else None."""
    if opts.quant.granularity != "block" or opts.partial_tiles == "quantize" or len(shape) != 2:
        return None
    br, bc = opts.quant.weight_block
    if shape[0] % br == 0 and shape[1] % bc == 0:
        return None
    return (
        f"{shape[0]}x{shape[1]} is not whole {br}x{bc} tiles; transformers' and vLLM's block-FP8 loaders "
        f"refuse partial tiles, so it stays in its source dtype"
    )


def partial_tile_modules(
    shapes: dict[str, list[int]], opts: ConvertOptions, kept: set[int] | None = None
) -> dict[str, dict[str, Any]]:
    """``{module: {"module", "shape", "reason"}}``: the decoder linears outside the ``kept`` layers that stay in
    their source dtype under ``partial_tiles="keep"`` (module docstring), from tensor name -> shape."""
    shape_of = {
        m["module"]: [int(d) for d in shape]
        for name, shape in shapes.items()
        if (m := DECODER_LINEAR.match(name)) and int(m["layer"]) not in (kept or set())
    }
    out = {
        module: {"module": module, "shape": shape, "reason": reason}
        for module, shape in shape_of.items()
        if (reason := partial_tile_reason(tuple(shape), opts)) is not None
    }
    for module in list(out):  # the other parts of the module vLLM fuses it into stay with it
        prefix, _, suffix = module.rpartition(".")
        prefix, _, kind = prefix.rpartition(".")
        group = next((g for g in FUSED_GROUPS if f"{kind}.{suffix}" in g), ())
        rows, cols = shape_of[module]
        for part in group:
            sibling = f"{prefix}.{part}"
            if sibling in shape_of and sibling not in out:
                out[sibling] = {
                    "module": sibling,
                    "shape": shape_of[sibling],
                    "reason": f"vLLM fuses it with {suffix} ({rows}x{cols}, not whole tiles) and a fused module "
                    "has one dtype, so it stays in its source dtype too",
                }
    return dict(sorted(out.items()))


# A conversion that leaves more than this share of the eligible decoder-linear weights (by element count) in their
# source dtype is refused unless asked for (``allow_unquantized``): its output would be called FP8 and be the source.
MIN_FP8_FRACTION = 0.5


def check_fp8_coverage(
    shapes: dict[str, list[int]], opts: ConvertOptions, kept: set[int], partial: dict[str, dict[str, Any]]
) -> tuple[int, int]:
    """``(quantized, eligible)`` decoder linears of a planned conversion; a :class:`CheckpointError` when fewer than
    ``MIN_FP8_FRACTION`` of the eligible weights' elements would be FP8, naming the options that would quantize them.

    Eligible: the 2-D decoder linears outside the ``kept`` BF16 layers; quantized: those not in ``partial``."""
    eligible = {
        m["module"]: shape
        for name, shape in shapes.items()
        if (m := DECODER_LINEAR.match(name)) and int(m["layer"]) not in kept and len(shape) == 2
    }
    elements = {module: int(shape[0]) * int(shape[1]) for module, shape in eligible.items()}
    total = sum(elements.values())
    fp8 = sum(n for module, n in elements.items() if module not in partial)
    quantized = sum(1 for module in eligible if module not in partial)
    if total and fp8 >= MIN_FP8_FRACTION * total:
        return quantized, len(eligible)
    br, bc = opts.quant.weight_block
    if not eligible:
        why = "every decoder layer is kept in BF16 (bf16_first_layers / bf16_last_layers)"
        fix = "keep fewer layers in BF16"
    else:
        why = (
            f"{len(eligible) - quantized} of them are not whole {br}x{bc} tiles (or fused with one that is not), "
            f"which vLLM's and transformers' block-FP8 loaders refuse, so they would stay in their source dtype"
        )
        fix = (
            "use --granularity row (per-channel scales: any width), or --partial-tiles quantize (ceil-div tiles: "
            "fp8rl's own engines read them, vLLM and transformers do not)"
        )
    raise CheckpointError(
        f"this conversion would quantize {quantized} of {len(eligible)} eligible decoder linears "
        f"({fp8 / total if total else 0.0:.0%} of their weights) with granularity={opts.quant.granularity}: {why}. "
        f"To quantize them, {fix}; --allow-unquantized writes the checkpoint anyway"
    )


def _validate_source(src: Path) -> dict[str, Any]:
    cfg = read_model_config(src)
    if "quantization_config" in cfg:
        method = cfg["quantization_config"].get("quant_method")
        raise CheckpointError(f"{src / 'config.json'}: checkpoint is already quantized (quant_method={method!r})")
    if "num_hidden_layers" not in cfg:
        raise CheckpointError(f"{src / 'config.json'}: num_hidden_layers is missing")
    if not isinstance(cfg["num_hidden_layers"], int):
        raise CheckpointError(f"{src / 'config.json'}: num_hidden_layers must be an integer")
    return cfg


def read_headers(root: Path, files: list[str]) -> dict[str, tuple[str, list[int]]]:
    """``{tensor: (file, shape)}`` from every shard's header; a corrupt or truncated file is a ``CheckpointError``."""
    found: dict[str, tuple[str, list[int]]] = {}
    for file in files:
        try:
            with safe_open(str(root / file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 -- safe_open is not a dict
                    if name in found:
                        raise CheckpointError(f"{root / file}: tensor {name} is also in {found[name][0]}")
                    found[name] = (file, list(f.get_slice(name).get_shape()))
        except SafetensorError as e:
            raise CheckpointError(f"{root / file}: not a readable safetensors file ({e}); is it truncated?") from None
    return found


def check_config_matches_weights(cfg: dict[str, Any], headers: dict[str, tuple[str, list[int]]], src: Path) -> None:
    """The config's layer count, hidden size and vocabulary must describe the weights (a clear error if not)."""
    where = src / "config.json"
    layers = {int(m["layer"]) for name in headers if (m := DECODER_LINEAR.match(name))}
    n = int(cfg["num_hidden_layers"])
    if layers and (max(layers) >= n or len(layers) != n):
        raise CheckpointError(
            f"{where}: num_hidden_layers is {n}, but the weights have decoder layers {sorted(layers)[:3]}..."
            f"{sorted(layers)[-1]} ({len(layers)} layers)"
        )
    embed = headers.get("model.embed_tokens.weight")
    if embed is not None and len(embed[1]) == 2:
        for key, got in (("vocab_size", embed[1][0]), ("hidden_size", embed[1][1])):
            if key in cfg and int(cfg[key]) != got:
                raise CheckpointError(f"{where}: {key} is {cfg[key]}, but model.embed_tokens.weight is {embed[1]}")


def _check_tensor(t: torch.Tensor, name: str, file: Path) -> None:
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CheckpointError(f"{file}: tensor {name} is already FP8 ({t.dtype}); the input must be bf16/fp16/fp32")
    if t.dtype not in SOURCE_DTYPES:
        raise CheckpointError(f"{file}: tensor {name} has unsupported dtype {t.dtype}; expected bf16, fp16 or fp32")
    if not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"{file}: tensor {name} holds NaN or Inf values")


def _convert_shard(
    src_file: Path,
    dst_file: Path,
    opts: ConvertOptions,
    spec: QuantSpec,
    kept: set[int],
    partial: dict[str, dict[str, Any]],
    progress: _Progress,
) -> dict[str, str]:
    """Convert one shard; returns the output weight map entries (tensor -> file name)."""
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(src_file), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 -- safe_open is not a dict
            try:
                t = f.get_tensor(name)
            except SafetensorError as e:
                raise CheckpointError(f"{src_file}: tensor {name} cannot be read ({e})") from None
            _check_tensor(t, name, src_file)
            match = DECODER_LINEAR.match(name)
            if match is None or int(match["layer"]) in kept or t.dim() != 2 or match["module"] in partial:
                out[name] = t
                progress.bar.update(1)
                continue
            q = quantize_weight(t, spec)
            scale = q.scale_inv.reshape(1) if opts.quant.granularity == "tensor" else q.scale_inv
            out[name] = q.data
            out[scale_name(match["module"], opts.quant.granularity)] = scale
            progress.tensors.append(TensorReport.measure(name, t, q))
            progress.bar.update(1)
    save_file(out, str(dst_file), metadata={"format": "pt"})
    return {name: dst_file.name for name in out}


def not_converted_modules(kept: set[int]) -> list[str]:
    """The linear modules a converted checkpoint keeps in high precision: lm_head and the ``kept`` layers' linears."""
    names = ["lm_head"]
    for layer in sorted(kept):
        names += [f"model.layers.{layer}.{suffix}" for suffix in DECODER_LINEAR_SUFFIXES]
    return names


def write_manifest(dst: Path, extra: dict[str, Any]) -> None:
    """sha256 of every file in ``dst`` (except the manifest itself) plus ``extra``."""
    files = {p.name: sha256_file(p) for p in sorted(dst.iterdir()) if p.is_file() and p.name != MANIFEST_NAME}
    manifest = {
        "tool": "fp8rl",
        "tool_version": fp8rl.__version__,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **extra,
        "files": files,
    }
    (dst / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _plan(
    src: Path, opts: ConvertOptions, allow_unquantized: bool
) -> tuple[dict[str, Any], ShardLayout, set[int], dict[str, dict[str, Any]], int]:
    """What a conversion of ``src`` will do, decided from the config and the shard headers before anything is
    written: (config, shard layout, kept BF16 layers, partial-tile modules kept in their dtype, tensor count).
    Every input is checked here, and the FP8 coverage too unless ``allow_unquantized``."""
    cfg = _validate_source(src)
    layout = shard_layout(src)
    kept = opts.kept_layers(int(cfg["num_hidden_layers"]))
    headers = read_headers(src, layout.files)
    check_config_matches_weights(cfg, headers, src)
    shapes = {name: shape for name, (_, shape) in headers.items()}
    partial = partial_tile_modules(shapes, opts, kept)
    if not allow_unquantized:
        check_fp8_coverage(shapes, opts, kept, partial)
    return cfg, layout, kept, partial, len(headers)


def convert_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    opts: ConvertOptions | None = None,
    overwrite: bool = False,
    show_progress: bool = True,
    on_shard: Callable[[str], None] | None = None,
    allow_unquantized: bool = False,
) -> ConversionReport:
    """Convert the HF checkpoint at ``src`` to an FP8 checkpoint at ``dst``.

    Raises :class:`CheckpointError` (or another :class:`fp8rl.errors.UserError`)
    for bad input; ``dst`` is then left as it was.  A conversion that would quantize less than
    ``MIN_FP8_FRACTION`` of the eligible decoder-linear weights is refused before anything is written
    (:func:`check_fp8_coverage`) unless ``allow_unquantized``.
    """
    opts = opts or ConvertOptions()
    spec = opts.spec()  # validates granularity / format / blocks
    if opts.partial_tiles not in PARTIAL_TILES:
        raise CheckpointError(f"partial_tiles must be one of {PARTIAL_TILES}, got {opts.partial_tiles!r}")
    src_path, dst_path = Path(src), Path(dst)
    cfg, layout, kept, partial, n_tensors = _plan(src_path, opts, allow_unquantized)

    with atomic_directory(dst_path, overwrite=overwrite) as tmp:
        bar = tqdm(
            total=n_tensors, desc=f"convert -> fp8 {opts.quant.granularity}", unit="tensor", disable=not show_progress
        )
        progress = _Progress(bar)
        weight_map: dict[str, str] = {}
        for file in layout.files:
            weight_map.update(_convert_shard(src_path / file, tmp / file, opts, spec, kept, partial, progress))
            if on_shard is not None:
                on_shard(file)
        bar.close()
        if layout.sharded:
            write_index(tmp, layout.files, weight_map)
        _write_config(tmp, cfg, opts, kept, partial)
        copy_side_files(src_path, tmp, {*layout.files, INDEX_NAME, "config.json"})
        report = ConversionReport(
            source=str(src_path),
            options=opts.record(),
            tensors=progress.tensors,
            kept_layers=sorted(kept),
            kept_partial_tiles=list(partial.values()),
        )
        report.bytes_before = sum((src_path / f).stat().st_size for f in layout.files)
        report.bytes_after = sum((tmp / f).stat().st_size for f in layout.files)
        _write_report_and_manifest(tmp, src_path, layout.files, report, opts, spec)
    return report


def _write_config(
    dst: Path, cfg: dict[str, Any], opts: ConvertOptions, kept: set[int], partial: dict[str, dict[str, Any]]
) -> None:
    """The source's config.json with the FP8 checkpoint's ``quantization_config``."""
    modules = not_converted_modules(kept) + list(partial)
    quant = quantization_config(opts.quant.granularity, opts.quant.weight_block, modules, opts.quant.fmt)
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}, indent=2) + "\n")


def _write_report_and_manifest(
    dst: Path, src: Path, files: list[str], report: ConversionReport, opts: ConvertOptions, spec: QuantSpec
) -> None:
    (dst / REPORT_JSON).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    (dst / REPORT_MD).write_text(report.to_markdown())
    source_hashes = {name: sha256_file(src / name) for name in [*files, "config.json"]}
    source = {"path": str(src.resolve()), "sha256": tree_digest(source_hashes), "files": source_hashes}
    recipe = {**opts.record(), "spec": dataclasses.asdict(spec)}
    write_manifest(dst, {"kind": "fp8-checkpoint", "source": source, "recipe": recipe})
