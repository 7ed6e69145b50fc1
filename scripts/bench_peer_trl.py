"""fp8rl's RL step beside a peer's: TRL's GRPOTrainer on the same GPU, model, prompts and batch, in one table.

    python scripts/bench_peer_trl.py --preset llama-8b-h200 --output-dir work/peer

runs, one after the other on the one GPU, ``fp8rl bench step --preset NAME`` (every recipe of the preset) and TRL's
``GRPOTrainer`` at the preset's settings, then writes ``peer.json`` (fp8rl's rows, ``peer: null``, and TRL's row,
``peer: "trl"``) and ``peer.md`` (the table) to the output directory.  ``--fp8rl-result FILE`` reuses a
``bench_step.json`` instead of running fp8rl again; ``--no-trl`` leaves TRL out.

What TRL runs (the preset's settings where TRL has them): the random-weight checkpoint fp8rl's bench makes for the
preset's shape (``WORK/bench-models/SHAPE``); prompts rendered from the same task's training problems; the preset's
prompts x samples per step, every response ``max_tokens`` long (vLLM's ``ignore_eos``); one optimizer step per
generation (``num_iterations`` 1, the gradient accumulated over micro-batches of 16 sequences, about the preset's
16,384 tokens); vLLM colocated in the trainer's process with sleep mode and the preset's
``rollout.gpu_memory_utilization``; activation checkpointing; BF16; no KL term and no importance-sampling
correction, as fp8rl's bf16 recipe (so neither computes a separate logprob pass).  Where the two differ: TRL trains
the BF16 parameters themselves with AdamW's state in BF16 on the GPU (an FP32 master copy, as fp8rl keeps, would not
fit beside the engine on one GPU at 8B); fp8rl keeps FP32 masters with AdamW's state in host memory between steps.

Times are medians of the timed steps after the warm-up ones, each bracketed by CUDA synchronisation: ``generate``
is vLLM's generation (its wake-up and sleep included), ``sync`` TRL's weight load into the engine, ``train`` the
rest of the step (scoring, the forward and backward passes, the optimizer step).  Peak GB is the GPU's used memory
(NVML, every process) over the timed steps, as fp8rl's bench reports it.

This is a benchmark runner, not part of fp8rl: TRL is not a dependency of the project.  It needs ``trl``
(1.16.0; it pins neither torch nor vLLM) and ``datasets`` beside fp8rl's GPU stack.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRL_ROWS_PER_MICRO_BATCH = 16  # sequences per micro-batch: 16 x ~1,040 tokens, about fp8rl's 16,384-token ones


def preset_settings(name: str) -> dict[str, Any]:
    """The preset's shape, batch and the settings TRL takes from it."""
    from fp8rl.bench.presets import get_preset

    p = get_preset(name)
    fields = p.run_fields({})
    return {
        "preset": name, "shape": p.shape, "prompts": p.prompts, "samples": p.samples, "max_tokens": p.max_tokens,
        "steps": p.steps, "warmup": p.warmup, "micro_batch_tokens": p.micro_batch_tokens,
        "gpu_memory_utilization": fields.get("rollout", {}).get("gpu_memory_utilization", 0.5),
        "max_model_len": fields.get("rollout", {}).get("max_model_len") or 2048,
        "activation_checkpointing": bool(fields.get("optim", {}).get("activation_checkpointing")),
        "lr": float(fields.get("optim", {}).get("lr", 1e-6)),
    }  # fmt: skip


def task_prompts(settings: dict[str, Any], count: int) -> list[str]:
    """``count`` prompts of the preset's task (its training problems, in the pool's order), as text."""
    from fp8rl.bench.presets import get_preset
    from fp8rl.build import prompt_format, task_examples
    from fp8rl.config import load_recipe, parse_run_config

    fields = {**get_preset(settings["preset"]).run_fields({}), "recipe": load_recipe("bf16")}
    cfg = parse_run_config(fields, "peer")
    train, _ = task_examples(cfg)
    fmt = prompt_format(cfg)
    if len(train) < count:
        raise SystemExit(f"bench_peer_trl: the task has {len(train)} training problems, {count} needed")
    return [fmt.text(e) for e in train[:count]]


# ------------------------------------------------------------------------------------------------ TRL's run


def prompt_dataset(prompts: list[str]) -> Any:
    """A ``datasets.Dataset`` of one ``prompt`` column, with a fixed fingerprint: ``datasets`` otherwise hashes the
    Arrow table by pickling it, which fails for some pyarrow/dill pairs (pyarrow's ``MonthDayNano``)."""
    import pyarrow as pa
    from datasets import Dataset

    return Dataset(pa.table({"prompt": prompts}), fingerprint="fp8rl-bench-peer-prompts")


class PhaseTimer:
    """Per-step phase times of a TRL run: ``wrap`` brackets one of the trainer's calls (``generate``, ``sync``) with
    CUDA synchronisation and adds its time to the current step; the trainer callback from ``callback`` times each
    optimizer step and closes it (one entry a step in ``phases``), and resets the peak-memory window after the
    warm-up steps."""

    def __init__(self, total: int, warmup: int, sampler: Any) -> None:
        self.total, self.warmup, self.sampler = total, warmup, sampler
        self.phases: dict[str, list[float]] = {"generate": [], "sync": [], "step": []}
        self.in_step = {"generate": 0.0, "sync": 0.0}  # this step's so far
        self.t0 = 0.0

    @staticmethod
    def _now() -> float:
        import torch

        if torch.cuda.is_available():  # the GPU's queued work belongs to the phase that queued it
            torch.cuda.synchronize()
        return time.perf_counter()

    def wrap(self, fn: Any, key: str) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = self._now()
            try:
                return fn(*a, **k)
            finally:
                self.in_step[key] += self._now() - t0

        return timed

    def step_begin(self) -> None:
        self.t0 = self._now()

    def step_end(self, global_step: int) -> None:
        self.phases["step"].append(self._now() - self.t0)
        for key in self.in_step:
            self.phases[key].append(self.in_step[key])
            self.in_step[key] = 0.0
        p = self.phases
        print(f"trl step {global_step}/{self.total}: {p['step'][-1]:.2f} s (generate {p['generate'][-1]:.2f} s, "
              f"sync {p['sync'][-1]:.2f} s)", flush=True)  # fmt: skip
        if global_step == self.warmup and self.sampler is not None:
            self.sampler.peak(reset=True)

    def callback(self) -> Any:
        """A ``transformers.TrainerCallback`` calling ``step_begin`` and ``step_end``."""
        from transformers import TrainerCallback

        timer = self

        class StepTimer(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, *_: Any, **__: Any) -> None:
                timer.step_begin()

            def on_step_end(self, _args: Any, state: Any, *__: Any, **___: Any) -> None:
                timer.step_end(state.global_step)

        return StepTimer()


def run_trl(model_dir: Path, settings: dict[str, Any], out: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer for warmup + steps optimizer steps at ``settings``; its row (medians of the timed steps)."""
    import random

    import torch
    import trl
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from fp8rl.cluster.memory import gpu_sampler

    total = settings["warmup"] + settings["steps"]
    n_seq = settings["prompts"] * settings["samples"]
    if n_seq % TRL_ROWS_PER_MICRO_BATCH:
        raise SystemExit(f"bench_peer_trl: {n_seq} sequences a step is not a multiple of {TRL_ROWS_PER_MICRO_BATCH}")
    prompts = task_prompts(settings, settings["prompts"] * total)
    rng = random.Random(0)

    def reward(completions: list[Any], **_: Any) -> list[float]:  # the values do not change the work
        return [rng.random() for _ in completions]

    timer = PhaseTimer(total, settings["warmup"], sampler=None)
    args = GRPOConfig(**grpo_arguments(settings, out))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(
        model=str(model_dir), reward_funcs=reward, args=args, processing_class=tokenizer,
        train_dataset=prompt_dataset(prompts), callbacks=[timer.callback()],
    )  # fmt: skip
    gen = trainer.vllm_generation
    gen.generate = timer.wrap(gen.generate, "generate")
    gen.sync_weights = timer.wrap(gen.sync_weights, "sync")
    timer.sampler = gpu_sampler(torch.cuda.current_device())
    trainer.train()
    peak = timer.sampler.peak() / 1e9 if timer.sampler is not None else None
    return trl_row(timer.phases, settings, peak, trl.__version__)


def grpo_arguments(settings: dict[str, Any], out: Path) -> dict[str, Any]:
    """TRL's ``GRPOConfig`` at the preset's settings (the module docstring says what each matches)."""
    n_seq = settings["prompts"] * settings["samples"]
    return {
        "output_dir": str(out / "trl-run"), "max_steps": settings["warmup"] + settings["steps"],
        "per_device_train_batch_size": TRL_ROWS_PER_MICRO_BATCH,
        "gradient_accumulation_steps": n_seq // TRL_ROWS_PER_MICRO_BATCH, "num_generations": settings["samples"],
        "max_completion_length": settings["max_tokens"], "generation_kwargs": {"ignore_eos": True},
        "temperature": 1.0, "learning_rate": settings["lr"], "lr_scheduler_type": "constant", "warmup_steps": 0,
        "weight_decay": 0.0, "max_grad_norm": 1.0, "optim": "adamw_torch_fused", "bf16": True, "beta": 0.0,
        "num_iterations": 1, "gradient_checkpointing": settings["activation_checkpointing"], "use_vllm": True,
        "vllm_mode": "colocate", "vllm_enable_sleep_mode": True,
        "vllm_gpu_memory_utilization": settings["gpu_memory_utilization"],
        "vllm_max_model_length": settings["max_model_len"], "vllm_importance_sampling_correction": False,
        "model_init_kwargs": {"dtype": "bfloat16"}, "logging_steps": 1, "report_to": "none", "save_strategy": "no",
        "shuffle_dataset": False, "seed": 0,
    }  # fmt: skip


def trl_row(phases: dict[str, list[float]], settings: dict[str, Any], peak_gb: float | None, version: str) -> dict:
    """TRL's row from its per-step phase times (``generate``, ``sync``, ``step``: one entry a step, the warm-up
    steps first): medians of the timed steps, tokens/s of the responses."""
    warm, steps = settings["warmup"], settings["steps"]
    for key, values in phases.items():
        if len(values) != warm + steps:
            raise RuntimeError(f"TRL ran {len(values)} {key} phases for {warm + steps} steps")
    timed = {k: v[warm:] for k, v in phases.items()}
    train = [s - g - y for s, g, y in zip(timed["step"], timed["generate"], timed["sync"], strict=True)]
    tokens = settings["prompts"] * settings["samples"] * settings["max_tokens"]
    med = {k: statistics.median(v) for k, v in timed.items()}
    train_s = statistics.median(train)
    return {
        "peer": "trl", "peer_version": version, "recipe": "bf16", "steps": steps, "warmup_steps": warm,
        "step_s": med["step"], "generate_s": med["generate"], "sync_s": med["sync"], "train_s": train_s,
        "logprob_s": 0.0, "rollout_tokens_per_s": tokens / med["generate"], "train_tokens_per_s": tokens / train_s,
        "peak_gpu_used_gb": peak_gb, "step_times": timed["step"],
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------ the table


def merged(fp8rl_doc: dict[str, Any], trl: dict[str, Any] | None) -> dict[str, Any]:
    """One document: fp8rl's rows (``peer`` None) and TRL's, each with its speedup over fp8rl's bf16 step and over
    TRL's (step, generate and train phases: higher is faster)."""
    rows = [{**r, "peer": None} for r in fp8rl_doc["results"]]
    if trl is not None:
        rows.append(trl)
    bases = {"fp8rl bf16": next((r for r in rows if r["peer"] is None and r["recipe"] == "bf16"), None), "trl": trl}
    for r in rows:
        r["speedup"] = {
            name: {k: base[f"{k}_s"] / r[f"{k}_s"] for k in ("step", "generate", "train") if r[f"{k}_s"] > 0}
            for name, base in bases.items() if base is not None
        }  # fmt: skip
    return {"meta": fp8rl_doc["meta"], "results": rows}


def markdown(doc: dict[str, Any]) -> str:
    """The table: one row per fp8rl recipe and per peer, step and phase times, speedups, tokens/s and peak GB."""
    lines = [
        "| run | step s | vs fp8rl bf16 | vs TRL bf16 | generate s | train s | sync s | rollout tok/s | train tok/s "
        "| peak GB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        name = f"TRL {r['peer_version']} GRPOTrainer, bf16" if r["peer"] else f"fp8rl {r['recipe']}"
        up = r["speedup"]
        x = [f"{up[b]['step']:.2f}x" if b in up else "-" for b in ("fp8rl bf16", "trl")]
        peak = r.get("peak_gpu_used_gb")
        lines.append(
            f"| {name} | {r['step_s']:.2f} | {x[0]} | {x[1]} | {r['generate_s']:.2f} | {r['train_s']:.2f} | "
            f"{r['sync_s']:.3f} | {r['rollout_tokens_per_s']:,.0f} | {r['train_tokens_per_s']:,.0f} | "
            f"{'-' if peak is None else f'{peak:.1f}'} |"
        )
    return "\n".join(lines) + "\n"


def write(doc: dict[str, Any], out: Path) -> list[Path]:
    from fp8rl.atomic import atomic_write_text

    files = [out / "peer.json", out / "peer.md"]
    atomic_write_text(files[0], json.dumps(doc, indent=1) + "\n")
    atomic_write_text(files[1], markdown(doc))
    return files


# ------------------------------------------------------------------------------------------------ the command


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", required=True, help="an fp8rl bench preset (fp8rl bench step --help lists them)")
    p.add_argument("--output-dir", default="work/peer", help="peer.json and peer.md (default work/peer)")
    p.add_argument("--work-dir", default="work", help="fp8rl's work dir: the shape's checkpoint (default work)")
    p.add_argument("--fp8rl-result", default=None, help="an existing bench_step.json instead of running fp8rl")
    p.add_argument("--no-trl", action="store_true", help="leave TRL out (fp8rl's rows alone)")
    p.add_argument("--trl-only", action="store_true", help=argparse.SUPPRESS)  # the TRL subprocess
    args = p.parse_args(argv)
    settings = preset_settings(args.preset)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.trl_only:
        from fp8rl.models.shapes import make_shape_model

        # fp8rl's bench made it already (the same shape and seed are reused); made on the GPU otherwise
        model = make_shape_model(settings["shape"], Path(args.work_dir) / "bench-models" / settings["shape"], "cuda")
        row = run_trl(model, settings, out)
        from fp8rl.atomic import atomic_write_text

        atomic_write_text(out / "trl.json", json.dumps(row, indent=1) + "\n")
        return 0
    fp8rl_json = Path(args.fp8rl_result) if args.fp8rl_result else out / "fp8rl" / "bench_step.json"
    if not args.fp8rl_result:
        cmd = [sys.executable, "-m", "fp8rl", "bench", "step", "--preset", args.preset, "--no-mlflow",
               "--work-dir", args.work_dir, "--output-dir", str(fp8rl_json.parent)]  # fmt: skip
        print("bench_peer_trl: " + " ".join(cmd), flush=True)
        if subprocess.run(cmd, check=False).returncode != 0:
            print("bench_peer_trl: fp8rl bench step failed; TRL still runs", file=sys.stderr, flush=True)
    trl = None
    if not args.no_trl:
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        cmd = [sys.executable, __file__, "--preset", args.preset, "--output-dir", str(out), "--work-dir",
               args.work_dir, "--trl-only"]  # fmt: skip
        print("bench_peer_trl: " + " ".join(cmd), flush=True)
        if subprocess.run(cmd, env=env, check=False).returncode == 0:
            trl = json.loads((out / "trl.json").read_text())
        else:
            print("bench_peer_trl: TRL's run failed", file=sys.stderr, flush=True)
    if not fp8rl_json.is_file():
        print(f"bench_peer_trl: {fp8rl_json}: no fp8rl result", file=sys.stderr)
        return 1
    doc = merged(json.loads(fp8rl_json.read_text()), trl)
    files = write(doc, out)
    print(markdown(doc))
    print("wrote " + ", ".join(map(str, files)))
    return 0 if trl is not None or args.no_trl else 1


if __name__ == "__main__":
    sys.exit(main())
