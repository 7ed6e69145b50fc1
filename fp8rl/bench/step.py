"""``fp8rl bench step``: the end-to-end RL step of each precision recipe at a given model shape.

What FP8 RL is for is a faster RL step at the same learning; this measures the step.  For one
model (a checkpoint, or random weights of a named shape: speed does not depend on the values)
it runs, per recipe and in one process after another, ``warmup`` untimed and ``steps`` timed RL
steps of the real loop (``fp8rl.bench.throughput.benchmark_recipe``: rollout, the trainer's
logprobs, the optimizer step, the requantized weight sync), with every response generated to
``max_tokens`` (EOS ignored: the same work for every recipe), and reports per recipe the median
step time and its breakdown (generate, logprob, train, sync, idle), rollout and train tokens/s,
padding waste, peak GPU memory (the process's; on Ray each GPU's), and each recipe's speedup over ``bf16``
measured in the same run.  The result is written as JSON, Markdown and a plot and, unless turned off, logged
to MLflow as a comparison (a parent run with one child run per recipe, the files as artifacts).

Everything a run config can say applies (``--config``, the Ray flags, ``--set``): the rollout engine (torch
or vLLM), the trainer (torch or TE), Ray workers, layout, trainer sharding and sync.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp8rl.atomic import atomic_write_text
from fp8rl.bench.profile_report import profile_table
from fp8rl.bench.profile_report import quantize_bytes as quantize_bytes  # re-exported: the report's callers
from fp8rl.bench.throughput import ThroughputResult, benchmark_recipe
from fp8rl.config import RunConfig, load_recipe, parse_run_config
from fp8rl.errors import UserError
from fp8rl.quant.launch_config import LAUNCH_ENV, launch_now

# trainer micro-batches of the benchmark when neither the command line nor the config sets one
DEFAULT_MICRO_BATCH_TOKENS = 16384


@dataclass(frozen=True)
class StepBench:
    """What ``fp8rl bench step`` runs."""

    recipes: Sequence[str] = ("bf16", "fp8-rollout", "fp8-e2e")
    prompts: int = 32
    samples: int = 8
    max_tokens: int = 1024
    steps: int = 2
    warmup: int = 1
    device: str = "auto"
    # None: the config's optim.micro_batch_tokens, else DEFAULT_MICRO_BATCH_TOKENS
    micro_batch_tokens: int | None = None
    # keep the bit-exact check of every weight sync (its time counts in the sync's); off: timing only
    verify_sync: bool = False
    # one more step per recipe, its policy step under the profiler: the train phase's kernel time by category
    profile_train: bool = False


def step_config(base: dict[str, Any], recipe: str, bench: StepBench, work_dir: str) -> RunConfig:
    """The run config of one recipe's timed steps: ``base`` (a run config's fields) with the bench's sizes."""
    data = dict(base)
    data["recipe"] = load_recipe(recipe)
    data["grpo"] = {**data.get("grpo", {}), "prompts_per_step": bench.prompts, "group_size": bench.samples}
    data["sampling"] = {**data.get("sampling", {}), "max_tokens": bench.max_tokens, "ignore_eos": True}
    optim = dict(data.get("optim", {}))
    if bench.micro_batch_tokens is not None:  # given on the command line: it wins over the config
        optim["micro_batch_tokens"] = bench.micro_batch_tokens
    elif optim.get("micro_batch_tokens") is None:
        optim["micro_batch_tokens"] = DEFAULT_MICRO_BATCH_TOKENS
    data["optim"] = optim
    data.setdefault("work_dir", work_dir)
    return parse_run_config(data, f"bench step ({recipe})")


def run_step_bench(
    model_dir: str | Path, bench: StepBench, base: dict[str, Any], work_dir: str,
    log: Callable[[str], None] = print, isolate: bool = False, parts_dir: Path | None = None, resume: bool = False,
) -> list[ThroughputResult]:  # fmt: skip
    """Each recipe's timed steps, one after another; ``isolate`` runs each in a process of its own (vLLM 0.26
    cannot start a second engine in a process whose first one it closed: its CUDA-graph memory pool asserts).

    ``parts_dir``: each recipe's result is written there as soon as it is measured (``NN-name.json``, with what it
    was measured with), so a run cut short keeps what it measured; ``resume`` reads back the recipes measured
    there with the same settings instead of running them again (other settings: an error naming the file)."""
    results = []
    for i, recipe in enumerate(bench.recipes, start=1):
        cfg = step_config(base, recipe, bench, work_dir)
        part = parts_dir / f"{i:02d}-{cfg.recipe.name}.json" if parts_dir is not None else None
        key = _part_key(cfg, model_dir, bench) if part is not None else {}
        if resume and part is not None and part.is_file():
            results.append(_read_part(part, key))
            log(f"bench step: recipe {i}/{len(bench.recipes)} {recipe}: measured before, read from {part}")
            continue
        log(f"bench step: recipe {i}/{len(bench.recipes)} {recipe}" + (" (own process)" if isolate else ""))
        if isolate:
            result = _in_subprocess(cfg, model_dir, bench, log)
        else:
            result = benchmark_recipe(
                cfg, model_dir, bench.device, bench.steps, bench.warmup, log=log, verify_sync=bench.verify_sync,
                profile_train=bench.profile_train,
            )  # fmt: skip
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if part is not None:
            part.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(part, json.dumps({"key": key, "result": result.to_dict()}, indent=1))
        results.append(result)
    return results


def _part_key(cfg: RunConfig, model_dir: str | Path, bench: StepBench) -> dict[str, Any]:
    """What a recipe's result depends on: its run config, the model, the steps and the device."""
    return {
        "config": cfg.model_dump(mode="json"), "model": str(model_dir), "steps": bench.steps,
        "warmup": bench.warmup, "device": bench.device, "verify_sync": bench.verify_sync,
        # only when on: parts measured before the flag existed still resume
        **({"profile_train": True} if bench.profile_train else {}),
        # the quantization kernels' launch, when set (the trainer workers inherit this process's environment)
        **({"quant_launch": launch_now()} if os.environ.get(LAUNCH_ENV) else {}),
    }  # fmt: skip


def _read_part(path: Path, key: dict[str, Any]) -> ThroughputResult:
    try:
        data = json.loads(path.read_text())
        stored, result = data["key"], ThroughputResult(**data["result"])
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"--resume: {path} is not a bench step result ({e}); remove it to measure again") from e
    if stored != key:
        fields = sorted(k for k in key if stored.get(k) != key[k])
        raise UserError(
            f"--resume: {path} was measured with other settings ({', '.join(fields)} differ); "
            "remove it, or run without --resume to measure again"
        )
    return result


def _in_subprocess(
    cfg: RunConfig, model_dir: str | Path, bench: StepBench, log: Callable[[str], None]
) -> ThroughputResult:
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, out_path = Path(tmp) / "run.json", Path(tmp) / "result.json"
        cfg_path.write_text(cfg.model_dump_json())
        cmd = [sys.executable, "-m", "fp8rl.bench.step", str(cfg_path), str(model_dir), bench.device,
               str(bench.steps), str(bench.warmup), str(out_path), str(int(bench.verify_sync)),
               str(int(bench.profile_train))]  # fmt: skip
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            assert proc.stdout is not None
            tail: list[str] = []
            for line in proc.stdout:
                tail = [*tail[-40:], line.rstrip()]
                if line.startswith(f"[{cfg.recipe.name}] bench step"):
                    log(line.rstrip())
        if proc.returncode != 0 or not out_path.is_file():
            raise RuntimeError(
                f"bench step of recipe {cfg.recipe.name} failed (exit {proc.returncode}):\n" + "\n".join(tail)
            )
        return ThroughputResult(**json.loads(out_path.read_text()))


def _subprocess_main(argv: Sequence[str]) -> None:
    """``python -m fp8rl.bench.step RUN_JSON MODEL DEVICE STEPS WARMUP OUT_JSON VERIFY PROFILE``: one recipe, for
    ``isolate``."""
    cfg_path, model_dir, device, steps, warmup, out, verify, profile = argv
    cfg = RunConfig.model_validate_json(Path(cfg_path).read_text())
    result = benchmark_recipe(cfg, model_dir, device, int(steps), int(warmup),
                              log=lambda line: print(line, flush=True), verify_sync=verify == "1",
                              profile_train=profile == "1")  # fmt: skip
    atomic_write_text(out, json.dumps(result.to_dict()))


def speedups(results: Sequence[ThroughputResult], baseline: str = "bf16") -> dict[str, dict[str, float]]:
    """Per recipe: step, rollout and train speedup over ``baseline`` from the same run (empty without it)."""
    base = next((r for r in results if r.recipe == baseline), None)
    if base is None:
        return {}

    def ratio(a: float, b: float) -> float:
        return a / b if b else math.nan  # a zero (nothing measured) makes no speedup

    return {
        r.recipe: {
            "step": ratio(base.step_s, r.step_s),
            "rollout": ratio(r.rollout_tokens_per_s, base.rollout_tokens_per_s),
            "train": ratio(r.train_tokens_per_s, base.train_tokens_per_s),
        }
        for r in results
    }


def _headline(meta: dict[str, Any]) -> str:
    """``llama-1b on 2x NVIDIA H100 ..., Ray split layout, 1 trainer (replicate) + 1 rollout worker(s), sync
    collective, 16 prompts x 8 samples x 1024 tokens``: the table's and the plot's title."""
    gpus, ray = meta.get("gpus") or 0, meta.get("ray")
    where = f"{gpus}x {meta.get('device_name')}" if gpus > 1 else str(meta.get("device_name"))
    if ray:  # a full RayConfig dump (run_metadata)
        where += (
            f", Ray {ray['layout']} layout, {ray['trainer_workers']} trainer ({ray['trainer_sharding']}) + "
            f"{ray['rollout_workers']} rollout worker(s), sync {ray['sync']}"
        )
    head = (
        f"{meta.get('model')} on {where}, {meta.get('prompts')} prompts x {meta.get('samples')} samples x "
        f"{meta.get('max_tokens')} tokens"
    )
    rollout, optim = meta.get("rollout") or {}, meta.get("optim") or {}  # absent in results written before them
    settings = [f"rollout {rollout['engine']}"] if "engine" in rollout else []
    if rollout.get("fp8_scaling") == "channel":
        settings.append("FP8 rollout weights per channel")
    if optim.get("micro_batch_tokens"):
        settings.append(f"{optim['micro_batch_tokens']}-token micro-batches")
    settings += [what for key, what in (("activation_checkpointing", "activation checkpointing"),
                                        ("compile_elementwise", "compiled norms, SiLU gate and rotary embedding"),
                                        ("offload_optimizer_state", "AdamW state offloaded")) if optim.get(key)]  # fmt: skip
    if ray and ray.get("trainer_sharding") == "fsdp" and optim.get("fp8_gather_once"):
        settings.append("FP8 layers gathered once per step")
    if ray and ray.get("trainer_sharding") == "fsdp" and optim.get("reduce_grads_once"):
        settings.append("gradients reduce-scattered once per step")
    launch = meta.get("quant_launch")
    if launch and meta.get("quant_launch_from_env"):
        settings.append(f"quantization launch rowwise {launch['rowwise']}, with transpose {launch['colwise']}")
    return head + (f" ({', '.join(settings)})" if settings else "")


def _peak_cell(r: ThroughputResult) -> str:
    """The "peak GB" cell: one process, its peak allocation; Ray, the fullest GPU's peak used memory, or on several
    GPUs each one's, named by its actors (the table's note says which)."""
    per_gpu = r.peak_gpu_used_gb_per_gpu
    if per_gpu and len(per_gpu) > 1:
        return ", ".join(f"{actors} {gb:.1f}" for actors, gb in per_gpu.items())
    peak = r.peak_gpu_used_gb if r.peak_gpu_used_gb is not None else r.peak_allocated_gb
    return f"{peak:.1f}" if peak is not None else "-"


def report(results: Sequence[ThroughputResult], meta: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The JSON document and the Markdown table of a step benchmark."""
    ups = speedups(results)
    doc = {
        "meta": meta,
        "results": [{**r.to_dict(), "idle_s": r.idle_s, "speedup_vs_bf16": ups.get(r.recipe)} for r in results],
    }
    lines = [
        f"RL step benchmark: {_headline(meta)}, median of {meta.get('steps')} steps after {meta.get('warmup')} warm-up"
        + (", every weight sync verified bit for bit" if meta.get("verify_sync") else ""),
        "",
        "| recipe | step s | vs bf16 | generate s | logprob s | train s | sync s | idle s | rollout tok/s | "
        "vs bf16 | train tok/s | vs bf16 | padding | peak GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        up = ups.get(r.recipe, {})

        def x(key: str, up: dict[str, float] = up) -> str:
            return f"{up[key]:.2f}x" if key in up else "-"

        peak = _peak_cell(r)
        lines.append(
            f"| {r.recipe} | {r.step_s:.2f} | {x('step')} | {r.generate_s:.2f} | {r.logprob_s:.2f} | {r.train_s:.2f} "
            f"| {r.sync_s:.3f} | {r.idle_s:.2f} | {r.rollout_tokens_per_s:,.0f} | {x('rollout')} | "
            f"{r.train_tokens_per_s:,.0f} | {x('train')} | {r.padding_waste:.1%} | {peak} |"
        )
    notes = _report_notes(results)
    if notes:
        lines += ["", *notes]
    lines += profile_table(results)
    return doc, "\n".join(lines) + "\n"


def _report_notes(results: Sequence[ThroughputResult]) -> list[str]:
    """The lines under the step table: each recipe's sync, offload and allocator notes, and what peak GB is."""
    notes: list[str] = []
    for r in results:
        parts = [
            f"FP8 KV-cache recalibration {r.kv_calibrate_s:.3f} s of the sync" if r.kv_calibrate_s is not None else "",
            f"the sleeping rollout engines freed {r.rollout_sleep_freed_gb:.1f} GB for training (all workers together)"
            if r.rollout_sleep_freed_gb is not None else "",
            f"sync: requantize {r.sync_requantize_s:.3f} s, transfer and load {r.sync_load_s:.3f} s"
            if r.sync_requantize_s > 0 else "",
            f"optimizer state to the host and back {r.optimizer_offload_s:.2f} s of train"
            if r.optimizer_offload_s is not None else "",
            f"{r.cuda_alloc_retries:.0f} allocator retries in the policy step"
            if r.cuda_alloc_retries else "",
        ]  # fmt: skip
        if any(parts):
            notes.append(f"- {r.recipe}: " + "; ".join(p for p in parts if p))
    if any(r.peak_gpu_used_gb is not None for r in results):
        notes.append("- peak GB: the peak used memory of each GPU (as nvidia-smi counts it: every process, caches "
                     "included), sampled over the timed steps")  # fmt: skip
    elif any(r.peak_allocated_gb is not None for r in results):
        notes.append("- peak GB: this process's peak CUDA allocation over the timed steps (torch's allocator)")
    return notes


def run_metadata(model: str, bench: StepBench, results: Sequence[ThroughputResult], cfg: RunConfig) -> dict[str, Any]:
    """What the run was: sizes, versions, the device and how many of its GPUs were visible, and ``cfg``'s (a
    recipe's step config) sections every recipe ran with: Ray (layout, workers, sharding, sync; None: one
    process), rollout (engine, FP8 scaling...) and optim (micro-batches, checkpointing, compile...)."""
    import transformers

    meta: dict[str, Any] = {
        "model": model, "prompts": bench.prompts, "samples": bench.samples, "max_tokens": bench.max_tokens,
        "steps": bench.steps, "warmup": bench.warmup, "recipes": list(bench.recipes), "verify_sync": bench.verify_sync,
        "profile_train": bench.profile_train, "quant_launch": launch_now(),
        "quant_launch_from_env": bool(os.environ.get(LAUNCH_ENV)),
        "device_name": results[0].device_name if results else None, "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "ray": cfg.ray.model_dump(mode="json") if cfg.ray is not None else None,
        "rollout": cfg.rollout.model_dump(mode="json"),
        "optim": cfg.optim.model_dump(mode="json"),
    }  # fmt: skip
    for name in ("vllm", "transformer_engine"):
        try:
            meta[name] = __import__(name).__version__
        except Exception:
            meta[name] = None
    return meta


def log_to_mlflow(
    results: Sequence[ThroughputResult], doc: dict[str, Any], files: Sequence[Path], work_dir: str, experiment: str
) -> str:
    """A parent run ``bench-step`` with the files as artifacts, one child run per recipe with its numbers."""
    from fp8rl.tracking.mlflow_sink import MlflowSink, recipe_tags

    meta = doc["meta"]
    with MlflowSink(experiment, f"bench-step {meta['model']}", work_dir, tags={"fp8rl.bench": "step"}) as parent:
        parent.log_params({k: v for k, v in meta.items() if v is not None and k != "recipes"})
        for path in files:
            parent.log_artifact(path)
        ups = speedups(results)
        for r in results:
            tags = recipe_tags(r.recipe)
            with MlflowSink(experiment, r.recipe, work_dir, parent_run_id=parent.run_id, tags=tags) as child:
                child.log_params(tags)
                metrics = {**r.metrics(), "bench/idle_s": r.idle_s}
                metrics.update({f"bench/speedup_{k}": v for k, v in ups.get(r.recipe, {}).items()})
                child.log_metrics(metrics, step=0)
        return parent.run_id


def write_outputs(
    doc: dict[str, Any], table: str, json_path: Path | None, md_path: Path | None, png_path: Path | None = None
) -> list[Path]:
    """The JSON document, the Markdown table and the plot (each written atomically); the paths written."""
    written = []
    if json_path is not None:
        atomic_write_text(json_path, json.dumps(doc, indent=2) + "\n")
        written.append(json_path)
    if md_path is not None:
        atomic_write_text(md_path, table)
        written.append(md_path)
    if png_path is not None and doc["results"]:
        from fp8rl.tracking.plots import plot_step_breakdown

        phases = ("generate_s", "logprob_s", "train_s", "sync_s", "idle_s")
        breakdown = {r["recipe"]: {p.removesuffix("_s"): r[p] for p in phases} for r in doc["results"]}
        ups = {r["recipe"]: r["speedup_vs_bf16"] or {} for r in doc["results"]}
        written.append(plot_step_breakdown(breakdown, ups, png_path, _headline(doc["meta"])))
    return written


if __name__ == "__main__":
    import sys

    _subprocess_main(sys.argv[1:])
