"""``fp8rl bench step`` on the command line: its arguments and its entry (``fp8rl.bench.step`` does the work).

Light on purpose: the ``fp8rl`` command builds its parser from this module, so torch and the RL loop are
imported only when the benchmark runs."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

from fp8rl.bench.presets import PRESETS, get_preset, preset_config
from fp8rl.config.flags import (
    add_device_argument,
    add_ray_arguments,
    add_recipes_argument,
    add_set_argument,
    apply_overrides,
    apply_ray_flags,
)
from fp8rl.errors import UserError

DEFAULT_RECIPES = "bf16,fp8-rollout,fp8-e2e"
# the sizes without --preset (a preset brings its own; a flag given wins over both)
DEFAULTS = {"prompts": 32, "samples": 8, "max_tokens": 1024, "steps": 2, "warmup": 1}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``fp8rl bench step``'s arguments (``fp8rl.cli`` adds the sub-command)."""
    p.add_argument(
        "--preset", default=None, metavar="NAME",
        help=f"a named layout (fp8rl.bench.presets: {' | '.join(PRESETS)}): its shape, recipes, batch and run-config "
        "settings; --config, the flags below and --set override it",
    )  # fmt: skip
    p.add_argument("--model", default=None, help="a checkpoint directory (or use --shape)")
    p.add_argument(
        "--shape", default=None, help="random weights of a shape: tiny | small | llama-1b | llama-3b | llama-8b"
    )
    add_recipes_argument(p, DEFAULT_RECIPES)
    _add_batch_arguments(p)
    add_device_argument(p)
    p.add_argument("--config", default=None, help="a run config whose other settings apply (engine, trainer, ray)")
    p.add_argument("--work-dir", default=None, help="models, runs and the MLflow store (default: the config's, work)")
    p.add_argument(
        "--output-dir", "--out", dest="out", default=None,
        help="directory for bench_step.json, .md and .png (default WORK/bench-step; --out is the same)",
    )  # fmt: skip
    p.add_argument("--experiment", default="fp8rl-bench", help="MLflow experiment (default: fp8rl-bench)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log the comparison to MLflow")
    add_ray_arguments(p)
    add_set_argument(p)
    _add_run_arguments(p)


def _add_batch_arguments(p: argparse.ArgumentParser) -> None:
    """The batch and the number of steps."""
    p.add_argument("--prompts", type=int, default=None, help=f"prompts per step (default {DEFAULTS['prompts']})")
    p.add_argument("--samples", type=int, default=None, help=f"responses per prompt (default {DEFAULTS['samples']})")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"tokens per response, EOS ignored (default {DEFAULTS['max_tokens']})",
    )
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per recipe (default {DEFAULTS['steps']})")
    p.add_argument(
        "--warmup", type=int, default=None, help=f"untimed steps per recipe before them (default {DEFAULTS['warmup']})"
    )
    p.add_argument(
        "--micro-batch-tokens", type=int, default=None,
        help="trainer micro-batch size in padded tokens (default: the config's optim.micro_batch_tokens, else 16384)",
    )  # fmt: skip


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """How the recipes run: sync checks, profiling, resuming, one process or one each."""
    p.add_argument(
        "--verify-sync", action="store_true",
        help="check every weight sync bit for bit, its time counted in the sync's (default: off, timing only)",
    )  # fmt: skip
    p.add_argument(
        "--profile-train", action="store_true",
        help="one more step per recipe after the timed ones, its policy step under the profiler: the train phase's "
        "kernel time by category (gemm, fp8_quantize, attention, optimizer, nccl, other) in the results",
    )  # fmt: skip
    p.add_argument(
        "--resume", action="store_true",
        help="read back the recipes already measured in OUT/recipes with the same settings instead of running them",
    )  # fmt: skip
    p.add_argument(
        "--one-process", action="store_true",
        help="run every recipe in this process (default: one process per recipe; vLLM starts once per process)",
    )  # fmt: skip


def resolve_preset(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sizes (prompts, samples, ...) and the run-config fields of ``args``: ``--preset``'s, a ``--config`` file's
    over them, the flags over both.  Sets ``args.shape`` from the preset when neither --model nor --shape is given."""
    from fp8rl.config import load_run_config_data

    config = load_run_config_data(args.config) if args.config else {}
    config.pop("recipe", None)
    sizes: dict[str, Any] = dict(DEFAULTS)
    if args.preset:
        preset = get_preset(args.preset)
        sizes.update(preset.sizes())
        # a copy: --set and the Ray flags write into these sections, which would otherwise be the preset's own
        config = copy.deepcopy(preset_config(preset, config))
        if args.model is None and args.shape is None:
            args.shape = preset.shape
    sizes.update({k: getattr(args, k) for k in DEFAULTS if getattr(args, k) is not None})
    return sizes, config


def _bench_model(args: argparse.Namespace, work: str | Path, device: str) -> Path:
    """``--model DIR``, or ``--shape NAME``'s random weights made under ``<work>/bench-models/NAME``."""
    if not args.shape:
        return Path(args.model)
    from fp8rl.models.shapes import make_shape_model

    print(f"bench step: random {args.shape} weights -> {Path(work) / 'bench-models' / args.shape}", flush=True)
    return make_shape_model(args.shape, Path(work) / "bench-models" / args.shape, device)


def main_with_args(args: argparse.Namespace) -> int:
    """``fp8rl bench step``: every recipe's timed steps, the table, JSON, Markdown, plot and MLflow comparison."""
    from fp8rl.bench.step import (
        StepBench,
        log_to_mlflow,
        report,
        run_metadata,
        run_step_bench,
        step_config,
        write_outputs,
    )  # fmt: skip
    from fp8rl.devices import resolve_device

    sizes, base = resolve_preset(args)
    if (args.model is None) == (args.shape is None):
        raise UserError("bench step: give exactly one of --model DIR or --shape NAME (or a --preset)")
    apply_ray_flags(base, args)
    apply_overrides(base, args.set)
    work = args.work_dir or base.get("work_dir", "work")
    device = resolve_device(args.device, "--device")
    bench = StepBench(
        recipes=args.recipes or sizes.get("recipes") or DEFAULT_RECIPES.split(","), prompts=sizes["prompts"],
        samples=sizes["samples"], max_tokens=sizes["max_tokens"], steps=sizes["steps"], warmup=sizes["warmup"],
        device=device, micro_batch_tokens=args.micro_batch_tokens or sizes.get("micro_batch_tokens"),
        verify_sync=args.verify_sync, profile_train=args.profile_train,
    )  # fmt: skip
    if args.preset:
        print(f"bench step: preset {args.preset}: {get_preset(args.preset).description}", flush=True)
    model = _bench_model(args, work, device)
    isolate = not args.one_process and len(bench.recipes) > 1
    out = Path(args.out or Path(work) / "bench-step")
    results = run_step_bench(model, bench, base, work, log=lambda line: print(line, flush=True), isolate=isolate,
                             parts_dir=out / "recipes", resume=args.resume)  # fmt: skip
    cfg = step_config(base, bench.recipes[0], bench, work)  # the sections every recipe shares
    doc, table = report(results, run_metadata(args.shape or str(model), bench, results, cfg))
    files = write_outputs(doc, table, out / "bench_step.json", out / "bench_step.md", out / "bench_step.png")
    print(table)
    print("wrote " + ", ".join(str(f) for f in files))
    if not args.no_mlflow:
        run_id = log_to_mlflow(results, doc, files, work, args.experiment)
        print(f"MLflow comparison run {run_id} (experiment {args.experiment})")
    failed = [r for r in results if r.train_profile_error]
    for r in failed:
        print(f"bench step: --profile-train: the profiled step of {r.recipe} failed: {r.train_profile_error}",
              file=sys.stderr)  # fmt: skip
    return 1 if failed else 0
