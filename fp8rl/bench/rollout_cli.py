"""``fp8rl bench rollout`` on the command line: its arguments and its entry (``fp8rl.bench.rollout`` does the work).

Light on purpose, as ``step_cli``: the ``fp8rl`` command builds its parser from this module, so torch and the
engines are imported only when the benchmark runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from fp8rl.config.flags import add_device_argument, add_recipes_argument, add_set_argument, apply_overrides

DEFAULT_RECIPES = "bf16,fp8-rollout"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``fp8rl bench rollout``'s arguments (``fp8rl.cli`` adds the sub-command)."""
    p.add_argument(
        "--model", required=True, metavar="DIR",
        help="an HF checkpoint directory (bf16; `fp8rl import-model shape:NAME DIR` writes random weights of a shape)",
    )  # fmt: skip
    p.add_argument(
        "--engine", choices=["vllm", "torch"], default=None,
        help="the rollout engine (default: the --config's rollout.engine, else vllm)",
    )  # fmt: skip
    add_recipes_argument(p, DEFAULT_RECIPES)
    p.add_argument(
        "--fp8-kv", action=argparse.BooleanOptionalAction, default=None,
        help="also measure every FP8 recipe with an FP8 KV cache (default: on with vllm, off with torch, whose "
        "KV cache is bf16)",
    )  # fmt: skip
    p.add_argument("--prompts", type=int, default=64, help="prompts in a batch (default 64)")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens a prompt, random ids (default 64)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens a response, EOS ignored (default 512)")
    p.add_argument("--repeats", type=int, default=3, help="timed batches per recipe, the median reported (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed batches per recipe before them (default 1)")
    p.add_argument("--seed", type=int, default=0, help="the prompts' token ids and the sampling (default 0)")
    add_device_argument(p)
    p.add_argument(
        "--config", default=None, metavar="FILE",
        help="a run config whose rollout settings apply (vLLM memory share, FP8 scaling, engine arguments)",
    )  # fmt: skip
    p.add_argument("--work-dir", default=None, help="converted FP8 checkpoints (default: the config's, work)")
    p.add_argument(
        "--output-dir", "--out", dest="out", default=None,
        help="directory for bench_rollout.json and .md (default WORK/bench-rollout; --out is the same)",
    )  # fmt: skip
    p.add_argument(
        "--one-process", action="store_true",
        help="measure every recipe in this process (default: one process per recipe; vLLM starts once per process)",
    )  # fmt: skip
    add_set_argument(p)


def main_with_args(args: argparse.Namespace) -> int:
    """``fp8rl bench rollout``: every recipe's generation throughput, the table, JSON and Markdown."""
    from fp8rl.bench.rollout import RolloutBench, bench_recipes, report, rollout_config, run_metadata
    from fp8rl.bench.rollout import run_rollout_bench as run
    from fp8rl.bench.step import write_outputs
    from fp8rl.config import load_run_config_data
    from fp8rl.devices import resolve_device
    from fp8rl.models.loading import read_model_config

    read_model_config(args.model)  # a directory with a config.json, before anything starts
    base = load_run_config_data(args.config) if args.config else {}
    apply_overrides(base, args.set)
    engine = args.engine or (base.get("rollout") or {}).get("engine", "vllm")
    work = args.work_dir or base.get("work_dir", "work")
    bench = RolloutBench(
        prompts=args.prompts, prompt_len=args.prompt_len, max_tokens=args.max_tokens, repeats=args.repeats,
        warmup=args.warmup, device=resolve_device(args.device, "--device"), seed=args.seed,
    )  # fmt: skip
    fp8_kv = args.fp8_kv if args.fp8_kv is not None else engine == "vllm"
    recipes = bench_recipes(args.recipes or DEFAULT_RECIPES.split(","), fp8_kv)
    configs = [rollout_config(base, recipe, engine, bench, work) for recipe in recipes]  # every error before a run
    isolate = not args.one_process and len(configs) > 1
    results = run(args.model, configs, bench, log=lambda line: print(line, flush=True), isolate=isolate)
    doc, table = report(results, run_metadata(args.model, bench, configs[0], results))
    out = Path(args.out or Path(work) / "bench-rollout")
    files = write_outputs(doc, table, out / "bench_rollout.json", out / "bench_rollout.md")
    print(table)
    print("wrote " + ", ".join(str(f) for f in files))
    return 0
