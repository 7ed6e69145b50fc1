"""GPU measurements of issue 13 beyond the kernel table: the torch trainer step and requantize + pack of an 8B model.

  trainer   TorchTrainer.sft_step (forward + backward + AdamW on fp32 masters) on 4 Llama-3-8B-width decoder
            layers, 8 x 2,048 tokens, torch BF16 vs torch FP8 (block, fused path), same process; median of
            --steps after --warmup.
  profile   device time of one trainer step by kernel category (GEMMs, FP8 quantization, attention, optimizer,
            the rest), BF16 vs FP8: the share of the step FP8 can speed up.
  rl        the RL train phase at Llama-3.2-1B shape (16 layers, hidden 2048, vocab 128,256; random weights):
            compute_logprobs + policy_step over 16 prompts x 8 samples x (128 + 1,024) tokens in micro-batches of
            4,096 padded tokens, BF16 vs FP8, eager vs ``optim.cuda_graphs``; what ``fp8rl bench step``'s
            logprob + train phases run, without the rollout.
  rlprofile the RL train phase as the 8B bench step runs it, without Ray or vLLM: Llama-3.1-8B width and vocabulary
            cut to --rl-layers layers, --rl-rows x (128 + --rl-response) tokens in micro-batches of --rl-mbt padded
            tokens, activation checkpointing (--compile-elementwise adds the compiled elementwise parts); wall time
            of compute_logprobs and policy_step, and one policy_step's device time by kernel category, BF16 vs FP8.
            Under ``torchrun --nproc-per-node N``: FSDP2 over the N GPUs (NCCL), each rank its share of the rows.
  requant   requantize_for_rollout + packing into sync buckets of a Llama-3.1-8B-shaped model (random bf16
            weights on the GPU): fused kernels vs the torch reference, with bytes moved / time vs the copy
            bandwidth measured in the same run.

Writes $OUT/fp8_speed.json (rewritten after each section). Run on the GPU machine from the repository root:
    PYTHONPATH=.:scripts python3 experiments/gpu_fp8_speed.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_sections, gpu_te_speed, beside this file

from gpu_sections import run_section, say
from gpu_te_speed import decoder_stack, opts

from fp8rl.bench.timing import copy_bandwidth_gbs, time_ms
from fp8rl.quant import QuantSpec
from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld
from fp8rl.train.step_profile import category, device_ms_by_category
from fp8rl.train.trainer import SequenceBatch, TorchTrainer

LLAMA8B = {"hidden": 4096, "inter": 14336, "layers": 32, "heads": 32, "kv": 8, "vocab": 128256}


def trainer_opts(a: argparse.Namespace, precision: str, mbs: int) -> Any:
    """The harness's trainer options; ``--compile-elementwise`` / ``--cuda-graphs`` turn on
    ``optim.compile_elementwise`` / ``optim.cuda_graphs`` for both precisions."""
    return dataclasses.replace(
        opts(precision, "block", "torch", mbs=mbs), compile_elementwise=a.compile_elementwise, cuda_graphs=a.cuda_graphs
    )


def llama_1b() -> Any:
    """Llama-3.2-1B's shape (random weights, bf16, on the GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=True, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)  # the same weights for every trainer: their logprobs are compared
    with torch.device("cuda"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16)


def rl_batch(rows: int, response: int, seed: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``rows`` random 128-token prompts with ``response``-token responses (every token valid): the batch, the
    advantages and the loss mask."""
    from fp8rl.train.trainer import build_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 128000, (128,), generator=g).tolist() for _ in range(rows)]
    batch = build_batch(prompts, torch.randint(1, 128000, (rows, response), generator=g), torch.ones(rows, response), 0)
    return batch, torch.randn(rows, generator=g), torch.ones(rows, response)


def timed_phases(
    trainer: TorchTrainer,
    batch: Any,
    adv: torch.Tensor,
    mask: torch.Tensor,
    a: argparse.Namespace,
    totals: tuple[float, float] | None = None,
) -> tuple[list[tuple[float, float]], torch.Tensor, dict[str, float]]:
    """``a.warmup`` + ``a.steps`` rounds of compute_logprobs then policy_step: the timed rounds' (logprob s, train
    s), the first round's logprobs and the last policy step's metrics."""
    from fp8rl.config import GRPOConfig

    times: list[tuple[float, float]] = []
    first: torch.Tensor | None = None
    m: dict[str, float] = {}
    for i in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        old = trainer.compute_logprobs(batch, 1.0)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        m = trainer.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0, totals))
        torch.cuda.synchronize()
        if i >= a.warmup:
            times.append((t1 - t0, time.perf_counter() - t1))
        first = old if first is None else first
    assert first is not None
    return times, first, m


def torchrun_ranks() -> tuple[int, int, str]:
    """(world size, rank, device): under ``torchrun`` the NCCL process group is made and this rank's GPU set."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world == 1:
        return 1, 0, "cuda"
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl")
    device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    torch.cuda.set_device(device)
    return world, rank, device


def section_rl(a: argparse.Namespace) -> dict[str, Any]:
    """The RL train phase (logprob recompute + policy step) at 1B shape: BF16 vs FP8, eager vs CUDA graphs."""
    from fp8rl.config import OptimConfig
    from fp8rl.train.trainer import TrainerOptions

    rows, prompt, response = a.rl_rows, 128, a.rl_response
    batch, adv, mask = rl_batch(rows, response, 0)
    out: dict[str, Any] = {"rows": rows, "prompt": prompt, "response": response, "micro_batch_tokens": 4096,
                           "cuda_graph_width": a.graph_width}  # fmt: skip
    logprobs: dict[str, torch.Tensor] = {}
    for precision in ("bf16", "fp8"):
        for graphs in (False, True):
            name = f"{precision}-{'graphs' if graphs else 'eager'}"
            torch.cuda.reset_peak_memory_stats()
            o = TrainerOptions(precision=precision, optim=OptimConfig(lr=1e-6, micro_batch_tokens=4096, cuda_graphs=graphs, cuda_graph_width=a.graph_width, compile_elementwise=a.compile_elementwise, warmup_steps=0))  # fmt: skip
            trainer = TorchTrainer(llama_1b(), o, device="cuda")
            times, logprobs[name], m = timed_phases(trainer, batch, adv, mask, a)
            lp, tr = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
            out[name] = {"logprob_s": lp, "train_s": tr, "phase_s": lp + tr, "tokens_per_s": rows * response / (lp + tr),
                         "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30, "step_times_s": times,
                         "tokens_computed": m["tokens_computed"],
                         **{k: v for k, v in m.items() if k.startswith("cuda_graph")}}  # fmt: skip
            say(f"[rl] {name}: logprob {lp:.2f} s, train {tr:.2f} s, {out[name]['tokens_per_s']:.0f} tok/s, "
                f"peak {out[name]['peak_mem_gb']:.1f} GB")  # fmt: skip
            del trainer
            torch.cuda.empty_cache()
        diff = (logprobs[f"{precision}-graphs"] - logprobs[f"{precision}-eager"]).abs()
        out[f"{precision}_graphs_vs_eager_logprob_max_abs_diff"] = float(diff.max())
    for mode in ("eager", "graphs"):
        out[f"fp8_vs_bf16_{mode}"] = out[f"bf16-{mode}"]["phase_s"] / out[f"fp8-{mode}"]["phase_s"]
    for precision in ("bf16", "fp8"):
        out[f"{precision}_graphs_vs_eager"] = (
            out[f"{precision}-eager"]["phase_s"] / out[f"{precision}-graphs"]["phase_s"]
        )
    say("[rl] " + ", ".join(f"{k} {v:.2f}x" for k, v in out.items() if k.endswith(("_eager", "_graphs", "vs_eager"))))
    return out


def section_trainer(a: argparse.Namespace) -> dict[str, Any]:
    n, seq = a.batch, a.seq
    ids = torch.randint(1, 2048, (n, seq))
    batch = SequenceBatch(
        ids, torch.ones_like(ids), torch.arange(seq).expand(n, seq).clone(), torch.ones(n, seq - 1), 1
    )
    out: dict[str, Any] = {"layers": a.layers, "batch": n, "seq": seq}
    for name, precision in [("torch-bf16", "bf16"), ("torch-fp8-block", "fp8"), ("torch-bf16-again", "bf16")]:
        torch.cuda.reset_peak_memory_stats()
        trainer = TorchTrainer(decoder_stack("llama3-8b", a.layers, seq), trainer_opts(a, precision, n), device="cuda")
        times = []
        for i in range(a.warmup + a.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.sft_step(batch)
            torch.cuda.synchronize()
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        out[name] = {"median_step_s": med, "tokens_per_s": n * seq / med, "step_times_s": times,
                     "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip
        say(f"[trainer] {name}: {med * 1e3:.1f} ms/step, {n * seq / med:.0f} tok/s")
        del trainer
        torch.cuda.empty_cache()
    base = statistics.median([out["torch-bf16"]["median_step_s"], out["torch-bf16-again"]["median_step_s"]])
    out["fp8_speedup_vs_bf16"] = base / out["torch-fp8-block"]["median_step_s"]
    return out


def section_profile(a: argparse.Namespace) -> dict[str, Any]:
    """Device time of one trainer step by kernel category, BF16 vs FP8: what bounds the step speedup."""
    from torch.profiler import ProfilerActivity, profile

    n, seq = a.batch, a.seq
    ids = torch.randint(1, 2048, (n, seq))
    batch = SequenceBatch(
        ids, torch.ones_like(ids), torch.arange(seq).expand(n, seq).clone(), torch.ones(n, seq - 1), 1
    )
    out: dict[str, Any] = {}
    for precision in ("bf16", "fp8"):
        trainer = TorchTrainer(decoder_stack("llama3-8b", a.layers, seq), trainer_opts(a, precision, n), device="cuda")
        for _ in range(2):
            trainer.sft_step(batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            trainer.sft_step(batch)
            torch.cuda.synchronize()
        top: list[tuple[str, str, float, int]] = []
        totals = categorize(prof, top)
        kernels_ms = [(name[:90], ms) for _, name, ms, _n in top]
        out[precision] = {"device_ms_by_category": totals, "device_ms_total": sum(totals.values()),
                          "top_kernels": sorted(kernels_ms, key=lambda t: -t[1])[:12]}  # fmt: skip
        say(
            f"[profile] {precision}: "
            + ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(totals.items(), key=lambda t: -t[1]))
        )
        del trainer
        torch.cuda.empty_cache()
    return out


def llama8b_stack(layers: int) -> Any:
    """Llama-3.1-8B's shape cut to ``layers`` decoder layers, with its 128,256-token vocabulary (random, bf16, GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=LLAMA8B["vocab"], hidden_size=LLAMA8B["hidden"], intermediate_size=LLAMA8B["inter"],
                      num_hidden_layers=layers, num_attention_heads=LLAMA8B["heads"],
                      num_key_value_heads=LLAMA8B["kv"], head_dim=128, max_position_embeddings=4096,
                      tie_word_embeddings=False, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16)


def categorize(prof: Any, top: list[tuple[str, str, float, int]] | None = None) -> dict[str, float]:
    """Device ms by kernel category (``fp8rl.train.step_profile``); ``top`` (if given) gets every kernel as
    (category, name, ms, launches)."""
    if top is not None:
        for e in prof.key_averages():
            if e.self_device_time_total > 0:
                top.append((category(e.key), e.key[:100], e.self_device_time_total / 1e3, e.count))
    return device_ms_by_category(prof, on_cuda=True)[0]


def section_rlprofile(a: argparse.Namespace) -> dict[str, Any]:
    """The RL train phase as the 8B bench step runs it, on one GPU: Llama-8B width and vocabulary, --rl-layers
    layers, --rl-rows x (128 + --rl-response) tokens in micro-batches of --rl-mbt padded tokens, activation
    checkpointing; wall time of compute_logprobs and policy_step, and policy_step's device time by kernel category
    (one step under the CUDA profiler), BF16 vs FP8: where the train phase's time goes."""
    from fp8rl.train.trainer import policy_batch_totals

    world, rank, device = torchrun_ranks()
    rows, response = a.rl_rows // world, a.rl_response
    batch, adv, mask = rl_batch(rows, response, rank)
    totals = policy_batch_totals(mask)  # every rank's share of the global loss, as the Ray trainer group passes it
    if world > 1:
        import torch.distributed as dist

        t = torch.tensor(totals, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        totals = (float(t[0]), float(t[1]))
    out: dict[str, Any] = {"rows_per_rank": rows, "ranks": world, "prompt": 128, "response": response,
                           "layers": a.rl_layers, "micro_batch_tokens": a.rl_mbt,
                           "activation_checkpointing": True, "compile_elementwise": a.compile_elementwise}  # fmt: skip
    for variant in a.rl_variants.split(","):  # a precision; "-regather": optim.fp8_gather_once off
        out[variant] = rlprofile_variant(variant, a, world, device, batch, adv, mask, totals)
    for fp8 in [v for v in a.rl_variants.split(",") if v.startswith("fp8") and "bf16" in out]:
        for k in ("logprob_s", "train_s"):
            out[f"{fp8}_vs_bf16_{k}"] = out["bf16"][k] / out[fp8][k]
        say(f"[rlprofile] {fp8} vs bf16: logprob {out[f'{fp8}_vs_bf16_logprob_s']:.2f}x, "
            f"train {out[f'{fp8}_vs_bf16_train_s']:.2f}x")  # fmt: skip
    return out


def rlprofile_variant(
    variant: str,
    a: argparse.Namespace,
    world: int,
    device: str,
    batch: Any,
    adv: torch.Tensor,
    mask: torch.Tensor,
    totals: tuple[float, float],
) -> dict[str, Any]:
    """One ``section_rlprofile`` variant: its timed phases, then the logprob phase and one profiled policy step (the
    profiled step's wall time, kernel ms by category and the compute stream's idle time), then a profiled logprob."""
    from torch.profiler import ProfilerActivity, profile

    from fp8rl.config import GRPOConfig, OptimConfig
    from fp8rl.train.trainer import TrainerOptions

    precision, *options = variant.split("-")  # bf16 | fp8, then the variant's options in any order
    if precision not in ("bf16", "fp8") or set(options) - {"row", "regather"}:
        raise ValueError(f"--rl-variants: {variant!r} is not bf16 or fp8 with -row / -regather")
    torch.cuda.reset_peak_memory_stats()
    o = TrainerOptions(precision=precision, sharding="fsdp" if world > 1 else "replicate", spec=QuantSpec(granularity="row" if "row" in options else "block"), optim=OptimConfig(lr=1e-6, micro_batch_tokens=a.rl_mbt, activation_checkpointing=True, compile_elementwise=a.compile_elementwise, fp8_gather_once="regather" not in options, warmup_steps=0))  # fmt: skip
    trainer = TorchTrainer(llama8b_stack(a.rl_layers), o, device=device)
    times, old, _ = timed_phases(trainer, batch, adv, mask, a, totals)
    trainer.compute_logprobs(batch, 1.0)  # as in the RL step: the logprob phase comes first (and gathers)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        trainer.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0, totals))
        torch.cuda.synchronize()
        profiled_s = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CUDA]) as prof_lp:
        trainer.compute_logprobs(batch, 1.0)
        torch.cuda.synchronize()
    r = {"logprob_s": statistics.median(t[0] for t in times), "train_s": statistics.median(t[1] for t in times),
         "step_times_s": times, "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
         "logprob_device_ms_by_category": categorize(prof_lp)}  # fmt: skip
    kernels: list[tuple[str, str, float, int]] = []
    cats = r["train_device_ms_by_category"] = categorize(prof, kernels)
    r["train_top_kernels"] = sorted(kernels, key=lambda t: -t[2])[:25]
    for cat, name, ms, n in r["train_top_kernels"][:14]:
        say(f"[rlprofile] {variant} {cat:>12} {ms:8.1f} ms {n:6d}x  {name}")
    r["train_device_ms_total"] = sum(cats.values())
    # the compute stream's idle time in the profiled step: its wall time less the non-NCCL kernels' sum
    r["profiled_train_s"] = profiled_s
    r["train_idle_s"] = profiled_s - sum(v for k, v in cats.items() if k != "nccl") / 1e3
    r["logprob_device_ms_total"] = sum(r["logprob_device_ms_by_category"].values())
    say(f"[rlprofile] {variant}: idle {r['train_idle_s']:.2f} s of {profiled_s:.2f} s; logprob {r['logprob_s']:.2f} s, "
        f"train {r['train_s']:.2f} s (device {r['train_device_ms_total']:.0f} ms: "
        + ", ".join(f"{k} {v:.0f}" for k, v in sorted(cats.items(), key=lambda t: -t[1]))
        + f"), peak {r['peak_mem_gb']:.1f} GB")  # fmt: skip
    del trainer
    torch.cuda.empty_cache()
    return r


def llama8b_weights() -> tuple[dict[str, torch.Tensor], set[str]]:
    h, f, kvd, v = LLAMA8B["hidden"], LLAMA8B["inter"], LLAMA8B["kv"] * 128, LLAMA8B["vocab"]
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g, dtype=torch.float32) * 0.02).to(torch.bfloat16)

    weights: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w(v, h)}
    fp8: set[str] = set()
    for i in range(LLAMA8B["layers"]):
        p = f"model.layers.{i}."
        for name, shape in [("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kvd, h)), ("self_attn.v_proj", (kvd, h)),
                            ("self_attn.o_proj", (h, h)), ("mlp.gate_proj", (f, h)), ("mlp.up_proj", (f, h)),
                            ("mlp.down_proj", (h, f))]:  # fmt: skip
            weights[p + name + ".weight"] = w(*shape)
            fp8.add(p + name + ".weight")
        weights[p + "input_layernorm.weight"] = torch.ones(h, device="cuda", dtype=torch.bfloat16)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    weights["model.norm.weight"] = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    weights["lm_head.weight"] = w(v, h)
    return weights, fp8


def section_requant(a: argparse.Namespace) -> dict[str, Any]:
    from fp8rl.sync import requantize_for_rollout
    from fp8rl.sync.buckets import layout_of, pack_bucket, plan_buckets

    weights, fp8 = llama8b_weights()
    spec = QuantSpec()
    params = sum(t.numel() for t in weights.values())
    fp8_params = sum(weights[n].numel() for n in fp8)
    payload = requantize_for_rollout(weights, fp8, spec)
    buckets = plan_buckets(layout_of(payload), a.bucket_mb << 20)
    buffer = torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8, device="cuda")

    def requant() -> None:
        requantize_for_rollout(weights, fp8, spec)

    def requant_and_pack() -> None:
        p = requantize_for_rollout(weights, fp8, spec)
        for b in buckets:
            pack_bucket(p, b, buffer[: b.nbytes])

    copy = copy_bandwidth_gbs()
    # bytes a requantization must move: read every bf16 weight, write FP8 (+ scales) or a bf16 copy
    payload_bytes = sum(b.nbytes for b in buckets)
    req_bytes = 2 * params + payload_bytes
    out: dict[str, Any] = {"params": params, "fp8_params": fp8_params, "payload_gb": payload_bytes / 1e9,
                           "buckets": len(buckets), "bucket_mb": a.bucket_mb, "copy_gb_per_s": copy}  # fmt: skip
    out["requant_ms"] = time_ms(requant, warmup=1, reps=5)
    out["requant_and_pack_ms"] = time_ms(requant_and_pack, warmup=1, reps=5)
    out["requant_gb_per_s"] = req_bytes / out["requant_ms"] / 1e6
    out["requant_fraction_of_copy"] = out["requant_gb_per_s"] / copy
    import fp8rl.sync.base as inproc

    orig = inproc.quantize_weight

    def torch_quantize_weight(w: torch.Tensor, s: QuantSpec, **kw: Any) -> Any:
        return orig(w, s, **{**kw, "backend": "torch"})

    inproc.quantize_weight = torch_quantize_weight  # the reference, for the before/after in one run
    try:
        out["requant_reference_ms"] = time_ms(requant, warmup=1, reps=3)
    finally:
        inproc.quantize_weight = orig
    say(f"[requant] 8B: fused {out['requant_ms']:.1f} ms, +pack {out['requant_and_pack_ms']:.1f} ms, "
        f"reference {out['requant_reference_ms']:.1f} ms; {out['requant_fraction_of_copy']:.0%} of copy")  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sections", default="trainer,requant,profile")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=1024)
    p.add_argument("--colwise-config", default=None, help="override the transposed-copy launch, e.g. 32,4,dual")
    p.add_argument("--compile-elementwise", action="store_true", help="optim.compile_elementwise for every trainer")
    p.add_argument(
        "--cuda-graphs", action="store_true", help="optim.cuda_graphs for every trainer of --sections trainer"
    )
    p.add_argument("--graph-width", type=int, default=128, help="rl section: optim.cuda_graph_width")
    p.add_argument("--rl-rows", type=int, default=128, help="rl section: sequences (prompts x samples)")
    p.add_argument("--rl-response", type=int, default=1024, help="rl section: response tokens")
    p.add_argument("--rl-layers", type=int, default=8, help="rlprofile section: decoder layers at Llama-8B width")
    p.add_argument("--rl-mbt", type=int, default=16384, help="rlprofile section: micro-batch padded tokens")
    p.add_argument("--rl-variants", default="bf16,fp8",
                   help="rlprofile section: bf16, fp8, fp8-row (the row recipe), fp8-regather (optim.fp8_gather_once off)")  # fmt: skip
    p.add_argument("--json", default="fp8_speed.json", help="file name under $OUT")
    a = p.parse_args()
    if a.colwise_config:
        from fp8rl.quant import launch_config

        size, warps, mode = a.colwise_config.split(",")
        launch_config.set_launch({"colwise": (int(size), int(warps), mode)})
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(os.environ.get("OUT", ".")) / (a.json if rank == 0 else f"rank{rank}-{a.json}")  # under torchrun
    if "LOCAL_RANK" in os.environ:  # this rank's GPU, before anything names or uses one
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "date": time.strftime("%Y-%m-%d"), "colwise_config": a.colwise_config,
                              "compile_elementwise": a.compile_elementwise, "cuda_graphs": a.cuda_graphs,
                              "sections": {}}  # fmt: skip
    fns = {
        "trainer": lambda: section_trainer(a),
        "requant": lambda: section_requant(a),
        "profile": lambda: section_profile(a),
        "rl": lambda: section_rl(a),
        "rlprofile": lambda: section_rlprofile(a),
    }
    for name in a.sections.split(","):
        entry = run_section(report, name, fns[name], out, say)
        if world > 1 and entry["status"] != "ok":  # the other ranks wait in a collective: end them all now
            os._exit(1)
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
