"""The speed sections of the TransformerEngine GPU check (experiments/gpu_te.py runs them), and the trainer helpers
both use.

  throughput   forward+backward+optimizer tokens/s (TorchTrainer.sft_step) of te-FP8 (block, current, delayed),
               te-BF16, torch-FP8 and torch-BF16 on stacks of decoder layers with Qwen2.5-1.5B and Llama-3-8B shapes.
  gemm         one linear's forward+backward at 8192x14336x4096 and 8192x4096x4096 (M x N x K): GPU time and the
               host time to enqueue it (where enqueue ~ total, launches bound the step and CUDA graphs would be
               needed for FP8 to pay).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from gpu_sections import Deadline, say, short_error

from fp8rl.config import OptimConfig
from fp8rl.quant import QuantSpec
from fp8rl.train.te_recipes import te_recipe_for
from fp8rl.train.trainer import SequenceBatch, TorchTrainer, TrainerOptions

SHAPES = {  # name: hidden, intermediate, heads, kv heads (head_dim 128)
    "qwen2.5-1.5b": (1536, 8960, 12, 2),
    "llama3-8b": (4096, 14336, 32, 8),
}
GRANS = {"block": ("block", "auto"), "current": ("tensor", "auto"), "delayed": ("tensor", "delayed")}


def spec_for(kind: str, pow2: bool = False) -> tuple[QuantSpec, str]:
    gran, te_recipe = GRANS[kind]
    return QuantSpec(granularity=gran, pow2_scales=pow2), te_recipe  # type: ignore[arg-type]


def opts(precision: str, kind: str = "block", backend: str = "te", mbs: int = 64) -> TrainerOptions:
    spec, te_recipe = spec_for(kind)
    return TrainerOptions(
        precision=precision,
        spec=spec,
        backend=backend,
        te_recipe=te_recipe,
        optim=OptimConfig(micro_batch_size=mbs, lr=2e-5, warmup_steps=0),
    )


def make_trainer(model: Any, o: TrainerOptions) -> TorchTrainer:
    if o.backend == "te":
        from fp8rl.train.te_trainer import TETrainer

        return TETrainer(model, o, device="cuda")
    return TorchTrainer(model, o, device="cuda")


def decoder_stack(shape: str, layers: int, seq: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, heads, kv = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=128, max_position_embeddings=seq,
                      tie_word_embeddings=False, pad_token_id=0)  # fmt: skip
    with torch.device("cuda"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16)


def time_steps(trainer: TorchTrainer, batch: SequenceBatch, warmup: int, steps: int, d: Deadline) -> list[float]:
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.sft_step(batch)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if d.out() and len(times) >= 2:
            break
    return times


def section_throughput(d: Deadline, root: Path, a: argparse.Namespace) -> dict[str, Any]:
    backends = [("torch-bf16", "bf16", "block", "torch"), ("torch-fp8-block", "fp8", "block", "torch"),
                ("te-bf16", "bf16", "block", "te"), ("te-fp8-block", "fp8", "block", "te"),
                ("te-fp8-current", "fp8", "current", "te"), ("te-fp8-delayed", "fp8", "delayed", "te")]  # fmt: skip
    n, seq = a.batch, a.seq
    ids = torch.randint(1, 2048, (n, seq))
    batch = SequenceBatch(
        ids, torch.ones_like(ids), torch.arange(seq).expand(n, seq).clone(), torch.ones(n, seq - 1), 1
    )
    out: dict[str, Any] = {"layers": a.layers, "batch": n, "seq": seq, "tokens_per_step": n * seq}
    for shape in SHAPES:
        rows: dict[str, Any] = {}
        for name, precision, kind, backend in backends:
            if d.out():
                rows[name] = "skipped: time"
                continue
            trainer = None
            try:
                torch.cuda.reset_peak_memory_stats()
                trainer = make_trainer(decoder_stack(shape, a.layers, seq), opts(precision, kind, backend, mbs=n))
                times = time_steps(trainer, batch, a.warmup, a.steps, d)
                med = statistics.median(times)
                rows[name] = {"median_step_s": med, "tokens_per_s": n * seq / med, "steps": len(times),
                              "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip
                say(f"[throughput] {shape} {name}: {rows[name]['tokens_per_s']:.0f} tok/s ({med * 1e3:.1f} ms/step)")
            except Exception as e:
                rows[name] = {"status": "failed", **short_error(e)}
                say(f"[throughput] {shape} {name} FAILED: {rows[name]['error']}")
            del trainer
            torch.cuda.empty_cache()
        ok = {k: v["tokens_per_s"] for k, v in rows.items() if isinstance(v, dict) and "tokens_per_s" in v}
        for base, pref in (("te-bf16", "te-fp8"), ("torch-bf16", "torch-fp8")):
            for k in ok:
                if k.startswith(pref) and base in ok:
                    rows[k]["speedup_vs_" + base] = ok[k] / ok[base]
        out[shape] = rows
    return out


def section_gemm(d: Deadline, root: Path) -> dict[str, Any]:
    import transformer_engine.pytorch as te

    from fp8rl.train.fp8_linear import FP8TrainLinear
    from fp8rl.train.te_trainer import build_te_recipe

    out: dict[str, Any] = {}
    for m, n, k in [(8192, 14336, 4096), (8192, 4096, 4096)]:
        rows: dict[str, Any] = {}
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        base = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        variants: dict[str, tuple[Any, Any]] = {
            "torch-bf16": (base, None),
            "torch-fp8-block": (FP8TrainLinear.from_linear(base, QuantSpec()), None),
        }
        variants["te-bf16"] = (te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda"), None)
        for kind in GRANS:  # a module per recipe: TE keeps per-module FP8 state (the delayed amax history)
            lin = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
            variants[f"te-fp8-{kind}"] = (lin, build_te_recipe(te_recipe_for(*spec_for(kind))))
        for name, (mod, recipe) in variants.items():
            if d.out():
                rows[name] = "skipped: time"
                continue
            try:
                rows[name] = time_linear(te, mod, recipe, x, g)
            except Exception as e:
                rows[name] = {"status": "failed", **short_error(e)}
        for name, r in rows.items():
            if (
                isinstance(r, dict)
                and "total_ms" in r
                and isinstance(rows.get("te-bf16"), dict)
                and "total_ms" in rows["te-bf16"]
            ):
                r["speedup_vs_te_bf16"] = rows["te-bf16"]["total_ms"] / r["total_ms"]
            if isinstance(r, dict) and "total_ms" in r:
                say(f"[gemm] {m}x{n}x{k} {name}: {r['total_ms']:.3f} ms fwd+bwd, enqueue {r['enqueue_ms']:.3f} ms")
        out[f"{m}x{n}x{k}"] = rows
    return out


def time_linear(te: Any, mod: Any, recipe: Any, x: torch.Tensor, g: torch.Tensor, reps: int = 20) -> dict[str, float]:
    def step() -> None:
        if recipe is None:
            y = mod(x)
        else:
            with te.autocast(enabled=True, recipe=recipe):
                y = mod(x)
        y.backward(g)

    for _ in range(3):
        step()
    totals, enqueues = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        totals.append(time.perf_counter() - t0)
        enqueues.append(t1 - t0)
        x.grad = None
        for p in mod.parameters():
            p.grad = None
    return {"total_ms": statistics.median(totals) * 1e3, "enqueue_ms": statistics.median(enqueues) * 1e3}
