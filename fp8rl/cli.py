"""The ``fp8rl`` command: thin argument parsing over library calls."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fp8rl.checkpoint.cli import add_checkpoint_parsers, add_import_parsers, add_quant_args, convert_options
from fp8rl.config.flags import (
    add_device_argument,
    add_ray_arguments,
    add_recipes_argument,
    add_set_argument,
    apply_overrides,
    apply_ray_flags,
)
from fp8rl.errors import UserError

if TYPE_CHECKING:
    from fp8rl.config import RunConfig


def _cmd_demo(args: argparse.Namespace) -> int:
    from fp8rl.checkpoint import REPORT_MD, convert_checkpoint
    from fp8rl.models import save_tiny_model

    work = Path(args.work_dir)
    model_dir = work / "models" / f"{args.preset}-bf16"
    if not model_dir.exists():
        save_tiny_model(model_dir, args.preset, seed=0)
    print(f"[1/2] tiny model: {model_dir}")
    dst = work / "models" / f"{args.preset}-fp8-{args.granularity}"
    convert_checkpoint(model_dir, dst, convert_options(args), overwrite=True)
    print(f"[2/2] FP8 checkpoint: {dst}\n")
    print((dst / REPORT_MD).read_text())
    return 0


def _warm_model(work: Path, preset: str, steps: int, seed: int, device: str = "cpu") -> Path:
    """The SFT-warmed tiny model, cached under the work dir by its options (and the device, when not the CPU)."""
    from fp8rl.train.sft import SFTOptions, sft_warmup

    opts = SFTOptions(preset=preset, steps=steps, seed=seed)
    path = work / "models" / f"sft-{preset}-{opts.cache_key()}{'' if device == 'cpu' else '-' + device}"
    if path.exists():
        print(f"using cached SFT warm-up {path}")
        return path
    result = sft_warmup(path, opts, device=device)
    print(f"SFT warm-up: held-out accuracy {result['heldout_accuracy']:.3f} in {result['seconds']:.0f}s -> {path}")
    return path


def _cmd_sft(args: argparse.Namespace) -> int:
    from fp8rl.devices import describe_device, resolve_device

    device = resolve_device(args.device, "--device")
    if args.model is None:
        if args.config or args.output_dir:
            raise UserError("--config and --output-dir warm up a given checkpoint: add --model DIR")
        print(f"sft: device {describe_device(device)}")
        _warm_model(Path(args.work_dir), args.preset, args.steps or 600, args.seed, device)
        return 0
    return _sft_checkpoint(args, device)


def _sft_checkpoint(args: argparse.Namespace, device: str) -> int:
    """``fp8rl sft --model DIR --config RUN.yaml --output-dir OUT``: a pretrained checkpoint on the run's task."""
    from fp8rl.build import validate_inputs
    from fp8rl.config import load_recipe, load_run_config_data, parse_run_config
    from fp8rl.devices import describe_device
    from fp8rl.supervised import SFT_RECORD, SFTSettings, sft_checkpoint

    if not args.config or not args.output_dir:
        raise UserError("--model: the warm-up of a checkpoint needs --config (the task) and --output-dir")
    data = load_run_config_data(args.config)
    apply_overrides(data, args.set)
    # the warm-up trains in BF16 whatever the config's recipe (the recipe is RL's); a config may name none
    recipe = data.get("recipe", "bf16")
    data["recipe"] = load_recipe(recipe).model_dump() if isinstance(recipe, str) else recipe
    cfg = parse_run_config(data, args.config)
    validate_inputs(cfg)
    settings = SFTSettings(args.steps or 100, args.batch_size, args.lr, args.seed, args.eval_every)
    print(f"sft: {args.model} on {cfg.task.type}, device {describe_device(device)}")
    record = sft_checkpoint(cfg, args.model, args.output_dir, settings, device, overwrite=args.overwrite)
    first, last = record["heldout_accuracy"][0][1], record["heldout_accuracy"][-1][1]
    loss0, loss1 = record["heldout_loss"][0][1], record["heldout_loss"][-1][1]
    print(
        f"sft: held-out accuracy {first:.3f} -> {last:.3f}, answer loss {loss0:.4f} -> {loss1:.4f} "
        f"in {record['seconds']:.0f}s -> {args.output_dir}"
    )
    print(f"wrote {Path(args.output_dir) / SFT_RECORD}")
    return 0


def _run_configs(args: argparse.Namespace) -> list[RunConfig]:
    """One config per (recipe, seed): the --config file (if any), the flags over it, then ``--set``."""
    from fp8rl.config import load_recipe, load_run_config_data, parse_run_config

    base = load_run_config_data(args.config) if args.config else {}
    flags = {
        "model": args.model,
        "steps": args.steps,
        "work_dir": args.work_dir,
        "experiment": args.experiment,
        "checkpoint_every": args.checkpoint_every,
        "device": args.device,
    }
    base.update({k: v for k, v in flags.items() if v is not None})
    apply_ray_flags(base, args)
    apply_overrides(base, args.set)
    recipes = args.recipes or [base.pop("recipe", "fp8-e2e")]
    try:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [base.get("seed", 0)]
    except ValueError:
        raise UserError(f"--seeds: expected comma-separated integers, got {args.seeds!r}") from None
    base.pop("recipe", None)
    source = args.config or "command line"
    out = []
    for name in recipes:
        recipe = load_recipe(name) if isinstance(name, str) else name
        for seed in seeds:
            out.append(parse_run_config({**base, "recipe": recipe, "seed": seed}, source))
    return out


def _cmd_train(args: argparse.Namespace) -> int:
    from fp8rl.build import validate_inputs
    from fp8rl.devices import resolve_device
    from fp8rl.experiment import compare_recipes, tracked_run
    from fp8rl.tracking import configure_mlflow

    cfgs = _run_configs(args)
    for c in cfgs:  # task files and the reward are checked before any model work (SFT warm-up takes minutes)
        validate_inputs(c)
    work = Path(cfgs[0].work_dir)
    sft_device = resolve_device(cfgs[0].device, "--device" if args.device else "device")
    models: dict[int, Path] = {}
    for c in cfgs:  # one starting checkpoint per seed, shared by that seed's recipes
        if c.seed not in models:
            models[c.seed] = (
                Path(c.model) if c.model else _warm_model(work, c.preset, args.sft_steps, c.seed, sft_device)
            )
    uri = configure_mlflow(work)
    if len(cfgs) == 1:
        cfg = cfgs[0]
        run = tracked_run(
            cfg,
            models[cfg.seed],
            parent_run_id=args.parent_run_id,
            output_dir=args.output_dir,
            checkpoint_dir=args.checkpoint_dir,
        )
        results = [run.result]
    elif args.parent_run_id or args.output_dir or args.checkpoint_dir:
        raise UserError("--parent-run-id, --output-dir and --checkpoint-dir take one recipe and one seed")
    else:
        # one model per seed: the comparison's children share their seed's starting point
        comparison = compare_recipes(cfgs, models, name=args.run_name)
        results = [r.result for r in comparison.runs]
        print(comparison.table)
    for c, r in zip(cfgs, results, strict=True):
        print(
            f"{c.recipe.name} seed {c.seed}: held-out accuracy {r.initial_accuracy:.3f} -> {r.final_accuracy:.3f}, "
            f"run-mean token_mult_prob_error {r.run_mean('mismatch/token_mult_prob_error'):.5f}"
        )
    print(f"open the runs: mlflow ui --backend-store-uri {uri}")
    return 0


def _add_train_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "train",
        help="run the RL loop (one process) for one or more recipes, tracked in MLflow",
        description="Several --recipe or --seeds run as child runs of one MLflow comparison run.",
    )
    add_recipes_argument(p, "the config's recipe, else fp8-e2e")
    p.add_argument("--config", default=None, metavar="FILE", help="a run config YAML (fields of RunConfig)")
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the SFT-warmed tiny model)")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the config's, 60)")
    p.add_argument("--seeds", default=None, metavar="S[,S...]", help="seeds, comma-separated (default: 0)")
    p.add_argument("--sft-steps", type=int, default=600, help="SFT warm-up steps when no --model is given")
    p.add_argument("--work-dir", default=None, help="runs, models and the MLflow store (default: work)")
    p.add_argument("--experiment", default=None, help="MLflow experiment (default: fp8rl)")
    p.add_argument("--run-name", default="recipe-comparison", help="name of the parent run of a comparison")
    p.add_argument("--parent-run-id", default=None, help="log as a child of this MLflow run (one recipe and seed)")
    p.add_argument("--output-dir", default=None, help="save the trained policy here (one recipe and seed)")
    p.add_argument(
        "--checkpoint-dir", default=None, help="checkpoint the loop here; a rerun resumes from it (one recipe and seed)"
    )
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N", help="checkpoint every N steps")
    add_device_argument(p, default=None)
    add_ray_arguments(p)
    add_set_argument(p)
    p.set_defaults(func=_cmd_train)


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from fp8rl.config import load_recipe, load_run_config_data, parse_run_config
    from fp8rl.diagnose import diagnose_run

    if args.target < 1.0:
        raise UserError(f"--target must be >= 1.0 (token_mult_prob_error), got {args.target}")
    data = load_run_config_data(args.config) if args.config else {}
    data["recipe"] = load_recipe(args.recipe).model_dump()
    cfg = parse_run_config(data, args.config or "diagnose")
    if cfg.recipe.rollout_precision != "fp8":
        raise UserError(f"--recipe {args.recipe}: its rollout is BF16, there is no FP8 disagreement to diagnose")
    from fp8rl.devices import describe_device, resolve_device

    device = resolve_device(args.device, "--device")
    print(f"diagnose: device {describe_device(device)}")
    diag = diagnose_run(
        cfg, args.model, args.out, args.target, args.examples, args.max_tokens, args.max_candidates, device
    )
    out = Path(args.out)
    print(diag.to_markdown())
    print(f"wrote {out / 'diagnosis.md'}, {out / 'diagnosis.json'}, {out / 'per_layer.png'}")
    return 0


def _cmd_bench_step(args: argparse.Namespace) -> int:
    from fp8rl.bench.step_cli import main_with_args

    return main_with_args(args)


def _cmd_bench_kernels(args: argparse.Namespace) -> int:
    from fp8rl.bench.kernels import main_with_args

    return main_with_args(args)


def version_string() -> str:
    """``fp8rl 0.1.0`` plus the git commit of the source when known (a checkout, or ``FP8RL_GIT_SHA`` in images)."""
    import fp8rl
    from fp8rl.provenance import git_sha

    sha = git_sha()
    return f"fp8rl {fp8rl.__version__}" + (f" (git {sha})" if sha else "")


class _Version(argparse.Action):
    """``--version``: the git look-up of ``version_string`` runs only when the flag is given."""

    def __call__(self, parser: argparse.ArgumentParser, *_args: object, **_kwargs: object) -> None:
        print(version_string())  # on stdout, as argparse's own version action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8rl", description="End-to-end FP8 reinforcement learning for LLMs.")
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version and exit")
    parser.add_argument(
        "--debug", action="store_true", help="print the whole traceback of an unexpected error (default: one line)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_checkpoint_parsers(sub)

    _add_sft_parser(sub)

    _add_train_parser(sub)
    add_import_parsers(sub)
    _add_diagnose_parser(sub)
    _add_bench_parsers(sub)
    from fp8rl.accuracy.cli import add_accuracy_parser

    add_accuracy_parser(sub)
    from fp8rl.tracking.cli import add_models_parser

    add_models_parser(sub)

    p = sub.add_parser(
        "recipes", help="the built-in precision recipes: what each quantizes, and what it was measured to cost or gain"
    )
    p.set_defaults(func=_cmd_recipes)

    p = sub.add_parser("demo", help="make the tiny model, convert it to FP8 and print the error report")
    p.add_argument("--work-dir", default="work", help="where the models are written (default: work)")
    p.add_argument("--preset", default="small", help="tiny-model preset: tiny | small | tiny-odd (default: small)")
    add_quant_args(p)
    p.set_defaults(func=_cmd_demo)
    return parser


def _cmd_recipes(_args: argparse.Namespace) -> int:
    """Each built-in recipe: rollout / training precision, scaling, KV cache, correction, then its description."""
    import textwrap

    from fp8rl.config import BUILTIN_RECIPES, load_recipe

    for name in BUILTIN_RECIPES:
        r = load_recipe(name)
        fp8 = "fp8" in (r.rollout_precision, r.train_precision)
        parts = [f"rollout {r.rollout_precision}", f"training {r.train_precision}"]
        parts += [f"{r.quant.granularity} scaling"] if fp8 else []
        parts += [f"KV cache {r.kv_cache}", f"correction {r.correction.type}"]
        print(f"{name}: {', '.join(parts)}")
        print(textwrap.fill(r.description, 100, initial_indent="  ", subsequent_indent="  "))
    print("Any of these names, or a recipe YAML file, is what --recipe / --recipes take (docs/accuracy.md: the runs)")
    return 0


def _add_sft_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sft", help="supervised warm-up: the tiny model on the arithmetic task (cached), or --model on a run's task",
        description="Without --model: the tiny model on the arithmetic task, cached under --work-dir. With --model "
        "DIR --config RUN.yaml --output-dir OUT: the checkpoint fine-tuned on the run config's task (prompt as the RL "
        "loop renders it, target the reference answer then the end-of-sequence token), held-out accuracy before and "
        "after; OUT is a checkpoint to start RL from.",
    )  # fmt: skip
    p.add_argument("--work-dir", default="work", help="where the warmed tiny model is cached (default: work)")
    p.add_argument("--preset", default="tiny", help="tiny-model preset: tiny | small | tiny-odd (default: tiny)")
    p.add_argument("--steps", type=int, default=None, help="SFT optimizer steps (default: 600 tiny, 100 --model)")
    p.add_argument("--seed", type=int, default=0, help="initial weights (tiny) and data order (default: 0)")
    p.add_argument("--model", default=None, help="an HF checkpoint directory to warm up (default: the tiny model)")
    p.add_argument("--config", default=None, metavar="FILE", help="with --model: the run config whose task to learn")
    p.add_argument("--output-dir", default=None, help="with --model: where the warmed checkpoint is written")
    p.add_argument("--batch-size", type=int, default=32, help="with --model: examples a step (default 32)")
    p.add_argument("--lr", type=float, default=1e-5, help="with --model: peak learning rate, cosine (default 1e-5)")
    p.add_argument(
        "--eval-every", type=int, default=0, metavar="N", help="with --model: held-out accuracy every N steps"
    )
    p.add_argument("--overwrite", action="store_true", help="with --model: replace an existing --output-dir")
    add_device_argument(p)
    add_set_argument(p)
    p.set_defaults(func=_cmd_sft)


def _add_diagnose_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "diagnose", help="attribute a recipe's FP8 disagreement to decoder layers; recommend BF16 layers"
    )
    p.add_argument("model", help="an HF checkpoint directory (bf16)")
    p.add_argument("--recipe", default="fp8-rollout", help="bf16 | fp8-rollout | fp8-e2e | recipe.yaml (its scaling)")
    p.add_argument("--config", default=None, help="a run config YAML: the task and prompt format to sample from")
    p.add_argument("--target", type=float, default=1.02, help="token_mult_prob_error to stay under (default 1.02)")
    p.add_argument("--examples", type=int, default=64, help="prompts sampled from the task (default 64)")
    p.add_argument("--max-tokens", type=int, default=None, help="response length (default: the config's)")
    p.add_argument("--max-candidates", type=int, default=64, help="BF16-layer settings to evaluate at most")
    add_device_argument(p)
    p.add_argument(
        "--output-dir", "--out", dest="out", default="diagnosis",
        help="output directory (default ./diagnosis; --out is the same)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_diagnose)


def _add_bench_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="benchmarks (GPU)").add_subparsers(dest="bench_command", required=True)
    p = bench.add_parser("kernels", help="FP8 quantization kernels, block GEMMs and the FP8 linear vs BF16 (CUDA)")
    from fp8rl.bench.kernels import add_arguments as add_kernel_bench_arguments

    add_kernel_bench_arguments(p)
    p.set_defaults(func=_cmd_bench_kernels)
    p = bench.add_parser("step", help="the end-to-end RL step per recipe: time breakdown, tokens/s, speedup vs bf16")
    from fp8rl.bench.step_cli import add_arguments as add_step_bench_arguments

    add_step_bench_arguments(p)
    p.set_defaults(func=_cmd_bench_step)
    p = bench.add_parser("rollout", help="generation throughput per recipe: bf16, FP8, FP8 + FP8 KV cache (tokens/s)")
    from fp8rl.bench.rollout_cli import add_arguments as add_rollout_bench_arguments
    from fp8rl.bench.rollout_cli import main_with_args as bench_rollout

    add_rollout_bench_arguments(p)
    p.set_defaults(func=bench_rollout)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (UserError, FileNotFoundError) as e:
        print(f"fp8rl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # an unexpected error: one line naming the step; --debug for the traceback
        if args.debug:
            raise
        where = args.command + (f" {sub}" if (sub := getattr(args, "bench_command", None)) else "")
        print(
            f"fp8rl {where}: unexpected error: {type(e).__name__}: {e} (rerun with fp8rl --debug {where} ... for the "
            "traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
