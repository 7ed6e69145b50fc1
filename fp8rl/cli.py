"""The ``fp8rl`` command: thin argument parsing over library calls."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fp8rl.errors import UserError

if TYPE_CHECKING:
    from fp8rl.checkpoint import ConvertOptions


def _add_quant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--granularity", choices=["block", "row", "tensor"], default="block", help="scaling granularity")
    p.add_argument("--pow2-scales", action="store_true", help="round scales up to powers of two")
    p.add_argument("--bf16-first-layers", type=int, default=0, metavar="N", help="keep the first N decoder layers")
    p.add_argument("--bf16-last-layers", type=int, default=0, metavar="N", help="keep the last N decoder layers")


def _cmd_make_model(args: argparse.Namespace) -> int:
    from fp8rl.models import save_tiny_model

    path = save_tiny_model(
        args.dst, args.preset, args.seed, max_shard_size=args.max_shard_size, overwrite=args.overwrite
    )
    print(f"wrote tiny model ({args.preset}) to {path}")
    return 0


def _options(args: argparse.Namespace) -> ConvertOptions:
    from fp8rl.checkpoint import ConvertOptions

    for field in ("bf16_first_layers", "bf16_last_layers"):
        if getattr(args, field) < 0:
            raise UserError(f"--{field.replace('_', '-')} must be >= 0, got {getattr(args, field)}")
    return ConvertOptions(
        granularity=args.granularity,
        pow2_scales=args.pow2_scales,
        bf16_first_layers=args.bf16_first_layers,
        bf16_last_layers=args.bf16_last_layers,
    )


def _cmd_convert(args: argparse.Namespace) -> int:
    from fp8rl.checkpoint import REPORT_MD, convert_checkpoint

    convert_checkpoint(args.src, args.dst, _options(args), overwrite=args.overwrite)
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


def _cmd_demo(args: argparse.Namespace) -> int:
    from fp8rl.checkpoint import REPORT_MD, convert_checkpoint
    from fp8rl.models import save_tiny_model

    work = Path(args.work_dir)
    model_dir = work / "models" / f"{args.preset}-bf16"
    if not model_dir.exists():
        save_tiny_model(model_dir, args.preset, seed=0)
    print(f"[1/2] tiny model: {model_dir}")
    dst = work / "models" / f"{args.preset}-fp8-{args.granularity}"
    convert_checkpoint(model_dir, dst, _options(args), overwrite=True)
    print(f"[2/2] FP8 checkpoint: {dst}\n")
    print((dst / REPORT_MD).read_text())
    return 0


def _warm_model(work: Path, preset: str, steps: int, seed: int) -> Path:
    """The SFT-warmed tiny model, cached under the work dir by its options."""
    from fp8rl.train.sft import SFTOptions, sft_warmup

    opts = SFTOptions(preset=preset, steps=steps, seed=seed)
    path = work / "models" / f"sft-{preset}-{opts.cache_key()}"
    if path.exists():
        print(f"using cached SFT warm-up {path}")
        return path
    result = sft_warmup(path, opts)
    print(f"SFT warm-up: held-out accuracy {result['heldout_accuracy']:.3f} in {result['seconds']:.0f}s -> {path}")
    return path


def _cmd_sft(args: argparse.Namespace) -> int:
    _warm_model(Path(args.work_dir), args.preset, args.steps, args.seed)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from fp8rl.config import load_recipe, parse_run_config
    from fp8rl.loop import run_rl
    from fp8rl.tracking import MlflowSink, configure_mlflow, recipe_tags

    recipe = load_recipe(args.recipe)
    cfg = parse_run_config(
        {
            "recipe": recipe.model_dump(),
            "model": args.model,
            "steps": args.steps,
            "seed": args.seed,
            "work_dir": args.work_dir,
            "experiment": args.experiment,
        },
        "command line",
    )
    work = Path(cfg.work_dir)
    model_dir = Path(cfg.model) if cfg.model else _warm_model(work, cfg.preset, args.sft_steps, cfg.seed)
    uri = configure_mlflow(work)
    with MlflowSink(cfg.experiment, f"{recipe.name}-seed{cfg.seed}", work, tags=recipe_tags(recipe.name)) as sink:
        resolved = cfg.model_dump(mode="json")
        resolved["recipe_config"] = resolved.pop("recipe")
        sink.log_params({**resolved, "recipe": recipe.name})
        result = run_rl(cfg, model_dir, sink)
    print(
        f"{recipe.name}: held-out accuracy {result.initial_accuracy:.3f} -> {result.final_accuracy:.3f}, "
        f"run-mean token_mult_prob_error {result.run_mean('mismatch/token_mult_prob_error'):.5f}"
    )
    print(f"open the runs: mlflow ui --backend-store-uri {uri}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8rl", description="End-to-end FP8 reinforcement learning for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a tiny model (no download) in Hugging Face format")
    p.add_argument("dst")
    p.add_argument("--preset", default="tiny", help="tiny | small | tiny-odd")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default=None, help='e.g. "1MB" for a sharded checkpoint')
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_cmd_make_model)

    p = sub.add_parser("convert", help="convert an HF checkpoint to an FP8 checkpoint vLLM/transformers load")
    p.add_argument("src")
    p.add_argument("dst")
    _add_quant_args(p)
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("dequantize", help="dequantize an FP8 checkpoint back to bf16 (or fp16/fp32)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_cmd_dequantize)

    p = sub.add_parser("sft", help="supervised warm-up of the tiny model on the arithmetic task (cached)")
    p.add_argument("--work-dir", default="work")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_sft)

    p = sub.add_parser("train", help="run the RL loop (one process) for a recipe, tracked in MLflow")
    p.add_argument("--recipe", default="fp8-e2e", help="bf16 | fp8-rollout | fp8-e2e | path to a recipe YAML")
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the SFT-warmed tiny model)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--work-dir", default="work")
    p.add_argument("--experiment", default="fp8rl")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("demo", help="make the tiny model, convert it to FP8 and print the error report")
    p.add_argument("--work-dir", default="work")
    p.add_argument("--preset", default="small")
    _add_quant_args(p)
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (UserError, FileNotFoundError) as e:
        print(f"fp8rl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
