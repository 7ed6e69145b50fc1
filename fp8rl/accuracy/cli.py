"""``fp8rl accuracy run | report``: the accuracy study (``fp8rl.accuracy``) from the command line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from fp8rl.config.flags import add_device_argument, add_recipes_argument, add_set_argument, apply_overrides
from fp8rl.errors import UserError

if TYPE_CHECKING:
    from fp8rl.config import RunConfig


def study_configs(args: argparse.Namespace) -> list[RunConfig]:
    """One run config per (recipe, seed): ``--config``, the flags over it, then ``--set``."""
    from fp8rl.config import load_recipe, load_run_config_data, parse_run_config

    base = load_run_config_data(args.config)
    flags = {"model": args.model, "steps": args.steps, "work_dir": args.work_dir, "device": args.device}
    base.update({k: v for k, v in flags.items() if v is not None})
    apply_overrides(base, args.set)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise UserError(f"--seeds: expected comma-separated integers, got {args.seeds!r}") from None
    recipes = args.recipes or [base.get("recipe", "fp8-e2e")]
    base.pop("recipe", None)
    out = []
    for name in recipes:
        recipe = load_recipe(name) if isinstance(name, str) else name
        for seed in seeds:
            cfg = parse_run_config({**base, "recipe": recipe, "seed": seed}, args.config)
            out.append(cfg.model_copy(update={"model": str(Path(cfg.model).resolve())}) if cfg.model else cfg)
    return out


def _cmd_run(args: argparse.Namespace) -> int:
    from fp8rl.accuracy.study import run_study
    from fp8rl.build import validate_inputs

    if args.parallel < 1:
        raise UserError(f"--parallel must be >= 1, got {args.parallel}")
    cfgs = study_configs(args)
    for c in cfgs:  # the task and the reward are checked before any run starts
        validate_inputs(c)
    outcome = run_study(
        cfgs, args.study, args.parallel, args.deadline_s, args.stagger_s, keep_checkpoints=args.keep_checkpoints
    )
    print(f"done {len(outcome['done'])}, failed {len(outcome['failed'])}, pending {len(outcome['pending'])}")
    if outcome["failed"]:
        print("failed: " + ", ".join(outcome["failed"]))
        return 1
    if outcome["pending"]:
        print("pending (run the same command again to resume): " + ", ".join(outcome["pending"]))
        return 3
    print(f"report: fp8rl accuracy report --work-dir {cfgs[0].work_dir} --study {args.study}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from fp8rl.accuracy.report import study_report
    from fp8rl.accuracy.study import PARENT_RUN_ID_FILE, study_dir

    parent = args.parent_run_id
    if parent is None:
        path = study_dir(args.work_dir, args.study) / PARENT_RUN_ID_FILE
        if not path.is_file():
            raise UserError(f"--study {args.study}: no study under {args.work_dir} ({path} not found)")
        parent = path.read_text().strip()
    report = study_report(args.experiment, parent, args.work_dir, args.json)
    text = report.markdown()
    print(text)
    if args.markdown:
        from fp8rl.atomic import atomic_write_text

        atomic_write_text(args.markdown, text)
    if args.json:
        print(f"wrote {args.json}")
    return 0


def add_accuracy_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    acc = sub.add_parser(
        "accuracy", help="held-out accuracy per recipe over seeds: does FP8 RL train as well as BF16?"
    ).add_subparsers(dest="accuracy_command", required=True)
    p = acc.add_parser(
        "run",
        help="run recipes x seeds, several at once, as children of one MLflow run; resumes when run again",
        description="Exit 0 when every run is done, 3 when the deadline left runs pending (run it again), 1 on a "
        "failed run.",
    )
    p.add_argument("--config", required=True, metavar="FILE", help="the run config YAML every run starts from")
    add_recipes_argument(p, "the config's recipe")
    p.add_argument("--seeds", default="0", metavar="S[,S...]", help="seeds, comma-separated (default: 0)")
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the config's model)")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the config's)")
    p.add_argument("--work-dir", default=None, help="runs, checkpoints and the MLflow store (default: the config's)")
    p.add_argument("--study", default="accuracy", help="the study's name: its directory and parent run")
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="runs at once on this machine (default 1)")
    p.add_argument(
        "--deadline-s", type=float, default=None, metavar="S",
        help="stop the running runs after S seconds (they resume from their checkpoints next time)",
    )  # fmt: skip
    p.add_argument("--stagger-s", type=float, default=0.0, metavar="S", help="seconds between two run starts")
    p.add_argument(
        "--keep-checkpoints", action="store_true",
        help="keep a finished run's loop checkpoints (default: removed once it is done; only a resume reads them)",
    )  # fmt: skip
    add_device_argument(p, default=None)
    add_set_argument(p)
    p.set_defaults(func=_cmd_run)

    p = acc.add_parser("report", help="the table per recipe, the targets, plots on the parent run, the JSON records")
    p.add_argument("--work-dir", default="work", help="where the study ran (default: work)")
    p.add_argument("--study", default="accuracy", help="the study's name (default: accuracy)")
    p.add_argument("--experiment", default="fp8rl", help="MLflow experiment (default: fp8rl)")
    p.add_argument("--parent-run-id", default=None, help="the parent run (default: the study's)")
    p.add_argument("--json", default=None, metavar="FILE", help="write one record per run here")
    p.add_argument("--markdown", default=None, metavar="FILE", help="write the tables here")
    p.set_defaults(func=_cmd_report)
