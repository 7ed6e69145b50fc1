"""Where a vLLM decode step goes beyond the bytes it must read (issue 17: "find why FP8 KV does not pay").

Random Qwen2.5-3B-shaped Llama (``gpu_vllm_throughput.py``'s checkpoints), BF16, block FP8, block FP8 + FP8 KV
cache; 64-token prompts, responses of a fixed length (EOS ignored), CUDA graphs on.  Per variant, the same generate
(``--batch`` x ``--max-tokens``) with the sampling options fp8rl's engine sets (a seed per request, the sampled
token's logprob as vLLM's flat lists), with the per-token logprob dicts it set before, and with neither, so the cost
of each shows; then the long-response run (``--long-batch`` x ``--long-tokens``, where the KV cache read outweighs
the weights) with and without fp8rl's options; then one shorter generate under the torch profiler, its CUDA kernel
time by category against the wall time (the rest is the host: scheduling, sampling launches, Python).  Next to it
the bytes roofline: weights + the mean KV cache read per decode step at the copy bandwidth measured in the same process.

    python experiments/gpu_vllm_overhead.py [--variants bf16,fp8,fp8-kv] [--max-tokens 1024] [--batch 256]
        [--long-tokens 4096] [--long-batch 128]   (--long-tokens 0: no long run) [--engine-process]

``--engine-process`` runs vLLM's engine core in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, ``vllm.LLM``
built with the engine's keyword arguments, no in-place reload), so the frontend's per-step output processing overlaps
the GPU.  On two H100s it measured the same ~8 ms host floor as fp8rl's in-process engine (docs/benchmarks.md, "Two
GPUs").  No profile there (the kernels run in the other process).  ``--modes`` picks some of the modes.

``--shape llama-8b`` (or another ``fp8rl bench step`` shape) serves that shape's random checkpoint instead
(``<FP8RL_GPU_WORK>/bench-models/<shape>``: the bench's own, reused when ``FP8RL_GPU_WORK`` is its ``--work-dir``).
The ``fp8-row`` and ``fp8-row-kv`` variants serve per-channel FP8 weights with dynamic per-token activation scales
(``rollout.fp8_scaling: channel``: the compressed-tensors checkpoint ``fp8rl convert`` writes for ``granularity:
row``; vLLM's W8A8 CUTLASS GEMM).  On 2026-11-26 they ran on a bare ``vllm.LLM`` with the engine's keyword
arguments, before fp8rl's engine served that layout; they run on fp8rl's engine now.  ``fp8-row-kvh`` is vLLM's
per-token-head FP8 cache (``rollout.kv_scaling: token_head``); ``VARIANT@BACKEND`` picks vLLM's attention backend;
``--profile-prompt 512`` profiles the decode at the 1,024-token run's mean context (docs/benchmarks.md, 2026-11-27);
``--host-profile 128`` adds a generate of 128 new tokens under cProfile (the host's time per decode step by function).
``--engine-process --interleave --repeats 3`` keeps every variant's engine up and times them in turns, the ratios
paired by round (one lease's drift between variants timed minutes apart moved the 8B ratio by ~0.18, 2026-11-27).
``VARIANT+KEY=VALUE`` adds a vLLM engine argument (``rollout.engine_kwargs``), e.g. ``fp8-row-kv+block_size=32``
beside ``fp8-row-kv`` in one interleaved run: the scheduler's per-step block work against the same engine's.

Writes $OUT/gpu_vllm_overhead.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

ENGINE_PROCESS = "--engine-process" in sys.argv
if ENGINE_PROCESS:  # before gpu_vllm sets fp8rl's in-process default
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"

from gpu_vllm import OUT, WORK, engine, free_gpu, kernel_names, start_report  # noqa: E402
from gpu_vllm_throughput import QWEN3B, write_random_3b  # noqa: E402

FP8RL = "seeded+flat logprobs (fp8rl)"
GC_OFF = "seeded+flat logprobs, gc off"
MODES = {  # name: (a seed per request, the sampled token's logprob, as vLLM's flat lists)
    FP8RL: (True, True, True),
    "seeded+logprob dicts": (True, True, False),
    "neither": (False, False, False),
    GC_OFF: (True, True, True),  # Python's collector paused during the generate, one full collection after (timed)
}


class ProcessEngine:
    """``vllm.LLM`` with its engine core in another process, built as fp8rl's engine builds it in-process."""

    def __init__(self, model_dir: Any, recipe: Any, rollout: Any) -> None:
        import vllm

        from fp8rl.config import rollout_recipe
        from fp8rl.rollout.vllm_engine import vllm_engine_kwargs

        t0 = time.perf_counter()
        self._vllm = vllm
        self.llm = vllm.LLM(**vllm_engine_kwargs(model_dir, rollout_recipe(recipe, rollout), rollout))
        print(f"vLLM engine (own process) up in {time.perf_counter() - t0:.1f}s", flush=True)

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm


def category(kernel: str) -> str:
    k = kernel.lower()
    if "flash" in k or "fwd_kernel" in k or "attn" in k or "attention" in k:
        return "attention"
    if "gemm" in k or "cutlass" in k or "sm90" in k or "matmul" in k or "cublas" in k or "nvjet" in k:
        return "gemm"
    if any(s in k for s in ("exponential", "softmax", "topk", "sort", "argmax", "sample", "gather", "scatter")):
        return "sampling/logprobs"
    if "cache" in k or "reshape_and_cache" in k:
        return "kv write"
    return "other"


def shape_dims(shape: str) -> dict[str, int]:
    """The model dimensions of ``--shape`` (qwen3b: gpu_vllm_throughput's; else fp8rl.models.shapes.SHAPES)."""
    if shape == "qwen3b":
        return dict(QWEN3B)
    from fp8rl.models.shapes import SHAPES

    s = SHAPES[shape]
    return {"hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
            "num_hidden_layers": s.num_hidden_layers, "num_attention_heads": s.num_attention_heads,
            "num_key_value_heads": s.num_key_value_heads, "head_dim": s.hidden_size // s.num_attention_heads,
            "vocab_size": s.vocab_size}  # fmt: skip


def roofline(
    c: dict[str, int], variant: str, batch: int, prompt: int, tokens: int, bandwidth: float
) -> dict[str, float]:
    """Bytes a decode step must read (every linear weight, the lm_head, the mean context's KV cache) at ``bandwidth``."""
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    linear = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)
    head = c["vocab_size"] * h  # the lm_head (tied or not) is read in bf16 every step
    base = variant_base(variant)
    weight_bytes = linear * (1 if not base.startswith("bf16") else 2) + head * 2
    kv_elem = 2.0  # bytes a cached value: BF16; -kv: FP8; -kvh: FP8 plus a float32 scale per token, head and K or V
    if base.endswith("-kvh"):
        kv_elem = 1 + 4 / c["head_dim"]
    elif base.endswith("-kv"):
        kv_elem = 1.0
    mean_context = prompt + tokens / 2
    kv_bytes = batch * mean_context * layers * 2 * kv * kv_elem
    return {
        "weight_gb": weight_bytes / 1e9,
        "mean_kv_gb": kv_bytes / 1e9,
        "roofline_step_ms": (weight_bytes + kv_bytes) / bandwidth * 1e3,
    }


def profile(e: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        e.llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    by_cat: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", 0.0) or getattr(evt, "cuda_time_total", 0.0)
        if us and evt.device_type == torch.autograd.DeviceType.CUDA:
            by_cat[category(evt.key)] += us / 1e3
            top[evt.key[:90]] += us / 1e3
    kernels_ms = sum(by_cat.values())
    return {
        "wall_ms": wall * 1e3,
        "kernel_ms": kernels_ms,
        "gpu_idle_share": max(0.0, 1 - kernels_ms / (wall * 1e3)),
        "kernel_ms_by_category": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:15]),
    }


def host_profile(e: Any, prompts: list[Any], params: Any, steps: int, top: int = 35) -> dict[str, Any]:
    """One generate under cProfile: where the host's time goes per decode step (``steps`` new tokens), the
    functions with the most own time and the most cumulative time, in ms a step.  cProfile slows Python, not
    the GPU, so the shares are an upper bound on the host's part; the wait for the GPU shows as the own time
    of the call that synchronises."""
    import cProfile
    import pstats

    import torch

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    e.llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    rows = [
        {"function": f"{os.path.relpath(f, '/tmp/site') if f.startswith('/tmp/site') else f}:{line}({name})",
         "calls": nc, "own_ms_per_step": tt * 1e3 / steps, "cumulative_ms_per_step": ct * 1e3 / steps}
        for (f, line, name), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()  # type: ignore[attr-defined]
    ]  # fmt: skip
    return {
        "wall_ms_per_step": wall * 1e3 / steps,
        "by_own_time": sorted(rows, key=lambda r: -r["own_ms_per_step"])[:top],
        "by_cumulative_time": sorted(rows, key=lambda r: -r["cumulative_ms_per_step"])[:top],
    }


def request_params(v: Any, mode: str, tokens: int, n: int) -> list[Any]:
    """``n`` requests of ``tokens`` new tokens (EOS ignored) with ``mode``'s sampling options."""
    seeded, logprobs, flat = MODES[mode]
    return [
        v.SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, detokenize=False,
                         seed=1_000_003 + i if seeded else None, logprobs=0 if logprobs else None, flat_logprobs=flat)
        for i in range(n)
    ]  # fmt: skip


def timed_generate(e: Any, mode: str, prompts_ids: list[list[int]], tokens: int, n: int) -> dict[str, float]:
    """One generate of the first ``n`` prompts, wall-clock timed (with ``GC_OFF``, the collection after it too)."""
    import torch

    prompts = [e._vllm.TokensPrompt(prompt_token_ids=list(x)) for x in prompts_ids[:n]]
    params = request_params(e._vllm, mode, tokens, n)
    torch.cuda.synchronize()
    t = time.perf_counter()
    if mode == GC_OFF:
        gc.disable()
    try:
        outs = e.llm.generate(prompts, params, use_tqdm=False)
    finally:
        if mode == GC_OFF:
            gc.enable()
            gc.collect()
    seconds = time.perf_counter() - t
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "tokens": got,
        "seconds": seconds,
        "tokens_per_s": got / seconds,
        "ms_per_decode_step": seconds / tokens * 1e3,
    }


def warm_up(e: Any, prompts_ids: list[list[int]], mode: str = FP8RL) -> None:
    """One short generate (16 requests x 32 tokens) before anything is timed."""
    prompts = [e._vllm.TokensPrompt(prompt_token_ids=list(x)) for x in prompts_ids[:16]]
    e.llm.generate(prompts, request_params(e._vllm, mode, 32, 16), use_tqdm=False)


def measure(e: Any, variant: str, args: Any, prompts_ids: list[list[int]], entry: dict[str, Any], save: Any) -> None:
    """Fill ``entry`` for one engine: the timed modes (repeated, order rotated), the long run, the profiles;
    ``save()`` after each result, so a run cut short keeps what it measured."""
    warm_up(e, prompts_ids)
    names = [m for m in MODES if m in args.modes] if args.modes else list(MODES)
    for r in range(args.repeats):
        for mode in names[r % len(names) :] + names[: r % len(names)]:
            run = timed_generate(e, mode, prompts_ids, args.max_tokens, args.batch)
            entry["modes"].setdefault(mode, {"runs": []})["runs"].append(run)
            print(f"{variant} {mode} (repeat {r + 1}): {json.dumps(run)}", flush=True)
            save()
    for runs in entry["modes"].values():
        steps = sorted(x["ms_per_decode_step"] for x in runs["runs"])
        runs.update(median_ms_per_decode_step=steps[len(steps) // 2], min_ms=steps[0], max_ms=steps[-1])
    picked = [m for m in (FP8RL, "neither") if not args.modes or m in args.modes]  # of the long run and profiles
    for mode in picked if args.long_tokens else ():
        entry["long"][mode] = timed_generate(e, mode, prompts_ids, args.long_tokens, args.long_batch)
        print(f"{variant} long {mode}: {json.dumps(entry['long'][mode])}", flush=True)
        save()
    # the profiled prompts: --profile-prompt tokens each (the 64-token prompts repeated), prefilled once before the
    # profiles so that they run from vLLM's prefix cache and the profile is the decode's
    reps = -(-args.profile_prompt // 64)
    prompts = [
        e._vllm.TokensPrompt(prompt_token_ids=(list(x) * reps)[: args.profile_prompt])
        for x in prompts_ids[: args.batch]
    ]
    if (args.profile_tokens or args.host_profile) and not ENGINE_PROCESS:
        e.llm.generate(prompts, request_params(e._vllm, "neither", 1, args.batch), use_tqdm=False)
    for mode in picked if args.profile_tokens and not ENGINE_PROCESS else ():
        prof = profile(e, prompts, request_params(e._vllm, mode, args.profile_tokens, args.batch))
        entry[f"profile {mode}"] = prof
        print(f"{variant} profile {mode}: {json.dumps(prof)[:1500]}", flush=True)
    if args.host_profile and not ENGINE_PROCESS:
        params = request_params(e._vllm, FP8RL, args.host_profile, args.batch)
        entry["host profile"] = hp = host_profile(e, prompts, params, args.host_profile)
        save()
        print(f"{variant} host profile: {hp['wall_ms_per_step']:.2f} ms/step", flush=True)
        for r in hp["by_own_time"][:25]:
            print(f"  own {r['own_ms_per_step']:7.3f}  cum {r['cumulative_ms_per_step']:7.3f}  {r['function']}")


VARIANTS = ("bf16", "fp8", "fp8-kv", "fp8-row", "fp8-row-kv", "fp8-row-kvh")


def parse_variant(variant: str) -> tuple[str, str | None, dict[str, Any]]:
    """``NAME[@BACKEND][+KEY=VALUE...]`` -> (NAME, BACKEND or None, {KEY: VALUE as YAML}); ``ValueError`` for a
    ``+`` part without ``=``."""
    import yaml

    name, *extra = variant.split("+")
    base, _, backend = name.partition("@")
    if any("=" not in e for e in extra):
        raise ValueError(f"{variant}: each +part is KEY=VALUE")
    return base, backend or None, {k: yaml.safe_load(v) for k, _, v in (e.partition("=") for e in extra)}


def variant_base(variant: str) -> str:
    """``NAME`` of a variant ``NAME[@BACKEND][+KEY=VALUE...]``."""
    return parse_variant(variant)[0]


def known_variant(variant: str) -> bool:
    try:
        return variant_base(variant) in VARIANTS
    except ValueError:
        return False


def variant_settings(variant: str, rollout: Any) -> tuple[Any, Any]:
    """A variant's rollout recipe (bf16, or fp8-rollout's block FP8; -kv: the FP8 KV cache with per-tensor scales,
    -kvh: with vLLM's per-token-head scales) and rollout config (fp8-row: ``fp8_scaling: channel``, per-channel
    weights the engine converts from BF16; ``@BACKEND``: vLLM's attention backend, e.g. ``fp8-row-kv@TRITON_ATTN``;
    each ``+KEY=VALUE``: a vLLM engine argument of ``rollout.engine_kwargs``, e.g. ``bf16+block_size=32``)."""
    from fp8rl.config import RolloutConfig, load_recipe

    base, backend, engine_kwargs = parse_variant(variant)
    recipe = load_recipe("bf16" if base == "bf16" else "fp8-rollout")
    if base.endswith(("-kv", "-kvh")):
        recipe = recipe.model_copy(update={"kv_cache": "fp8"})
    update = {
        "fp8_scaling": "channel" if base.startswith("fp8-row") else "recipe",
        "kv_scaling": "token_head" if base.endswith("-kvh") else "tensor",
        "attention_backend": backend,
        "engine_kwargs": rollout.engine_kwargs | engine_kwargs,
    }
    return recipe, RolloutConfig.model_validate(rollout.model_dump() | update)


def random_checkpoints(shape: str) -> tuple[Any, Any]:
    """(BF16, FP8) checkpoints of ``shape``: qwen3b's two, or the bench's BF16 one for both (fp8rl's engine
    converts it to FP8 under WORK / "o")."""
    if shape == "qwen3b":
        return write_random_3b(WORK / "qwen3b-bf16", fp8=False), write_random_3b(WORK / "qwen3b-fp8", fp8=True)
    from fp8rl.models.shapes import make_shape_model

    bf16 = make_shape_model(shape, WORK / "bench-models" / shape, "cuda")
    return bf16, bf16


def start_engine(variant: str, recipe: Any, rollout: Any, bf16_dir: Any, fp8_dir: Any) -> Any:
    """The variant's engine: fp8rl's in this process, or ``ProcessEngine`` on the checkpoint fp8rl's would serve.
    Per-channel variants start from BF16 (the qwen3b FP8 checkpoint is block)."""
    model_dir = bf16_dir if variant.startswith("bf16") or rollout.fp8_scaling == "channel" else fp8_dir
    if not ENGINE_PROCESS:
        return engine(model_dir, recipe, WORK / "o", rollout=rollout)
    from fp8rl.config import rollout_recipe
    from fp8rl.rollout.vllm_weights import serving_checkpoint

    return ProcessEngine(serving_checkpoint(model_dir, rollout_recipe(recipe, rollout), WORK / "o"), recipe, rollout)


def interleaved(args: Any, results: dict[str, Any], rollout: Any, dirs: tuple[Any, Any], prompts_ids: list[list[int]],
                save: Any) -> None:  # fmt: skip
    """``--interleave``: every variant's engine up at once (each engine core in its own process, with
    ``--gpu-memory-utilization`` of the GPU each), then ``--repeats`` rounds of one timed generate per variant, the
    order rotated each round, so that each round's ratios to the first variant are paired in time (the machine's
    drift between variants measured minutes apart is what single runs could not separate, docs/benchmarks.md)."""
    mode = args.modes[0] if args.modes else FP8RL
    engines: dict[str, Any] = {}
    try:
        for variant in args.variants:
            recipe, served = variant_settings(variant, rollout)
            engines[variant] = e = start_engine(variant, recipe, served, *dirs)
            warm_up(e, prompts_ids, mode)
            results["variants"][variant] = {"engine_process": True, "interleaved": True, "modes": {mode: {"runs": []}}}
        names = list(engines)
        rounds: list[dict[str, float]] = []
        for r in range(args.repeats):
            steps: dict[str, float] = {}
            for variant in names[r % len(names) :] + names[: r % len(names)]:
                run = timed_generate(engines[variant], mode, prompts_ids, args.max_tokens, args.batch)
                results["variants"][variant]["modes"][mode]["runs"].append(run)
                steps[variant] = run["ms_per_decode_step"]
                print(f"{variant} round {r + 1}: {json.dumps(run)}", flush=True)
                save()
            rounds.append({v: steps[names[0]] / steps[v] for v in names})
        results["paired_speedup"] = {
            "baseline": names[0],
            "per_round": rounds,
            "median": {v: statistics.median(x[v] for x in rounds) for v in names},
        }
        print(f"paired speedup vs {names[0]} (median of {len(rounds)}): {results['paired_speedup']['median']}")
        save()
    finally:
        for e in engines.values():
            e.close()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="bf16,fp8,fp8-kv", help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--shape", default="qwen3b", help="qwen3b, or a shape of fp8rl bench step (e.g. llama-8b)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.55,
                   help="the engines' share of the GPU (0.55 of an H200 holds the 8B shape's BF16 cache at batch 256; "
                        "an H100 needs ~0.85)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--long-batch", type=int, default=128)
    p.add_argument("--long-tokens", type=int, default=4096)
    p.add_argument("--profile-tokens", type=int, default=128, help="0: no profiled generate")
    p.add_argument("--profile-prompt", type=int, default=64,
                   help="prompt tokens of the profiled generate (512 with 128 new tokens: the mean context of the "
                        "1,024-token run)")  # fmt: skip
    p.add_argument(
        "--host-profile",
        type=int,
        default=0,
        help="new tokens of one more generate under cProfile (fp8rl's sampling, at --profile-prompt); 0: none",
    )
    p.add_argument("--repeats", type=int, default=1, help="timed generates per mode, the mode order rotated each time")
    p.add_argument("--engine-process", action="store_true", help="vLLM's engine core in its own process")
    p.add_argument("--interleave", action="store_true",
                   help="with --engine-process: all variants' engines up at once, --repeats rounds of one timed "
                        "generate each (the first of --modes), ratios paired by round; each engine takes "
                        "--gpu-memory-utilization (0.45 for two at the 8B shape: an H200)")  # fmt: skip
    p.add_argument("--modes", default="", help="comma-separated subset of the modes (fp8rl, dicts, neither, gc-off)")
    args = p.parse_args()
    short = {"fp8rl": FP8RL, "dicts": "seeded+logprob dicts", "neither": "neither", "gc-off": GC_OFF}
    unknown = [m for m in args.modes.split(",") if m and m not in short]
    if unknown:
        p.error(f"--modes: unknown {unknown}; expected some of {sorted(short)}")
    args.modes = [short[m] for m in args.modes.split(",") if m]
    if args.interleave and not args.engine_process:
        p.error("--interleave needs --engine-process (two in-process engines cannot share a process)")
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if not known_variant(v)]
    if unknown:
        p.error(f"--variants: unknown {unknown}; expected some of {VARIANTS}")
    return args


def main() -> None:
    args = parse_args()
    import torch

    from fp8rl.bench.timing import copy_bandwidth_gbs
    from fp8rl.config import RolloutConfig

    results = start_report()
    out = OUT / "gpu_vllm_overhead.json"
    bw = copy_bandwidth_gbs() * 1e9
    dims = shape_dims(args.shape)
    results.update(copy_bandwidth_gb_s=bw / 1e9, batch=args.batch, max_tokens=args.max_tokens, variants={},
                   long_batch=args.long_batch, long_tokens=args.long_tokens, shape=args.shape, dims=dims)  # fmt: skip
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    bf16_dir, fp8_dir = random_checkpoints(args.shape)
    model_len = max(64 + max(args.max_tokens, args.long_tokens), args.profile_prompt + args.profile_tokens) + 64
    rollout = RolloutConfig(
        engine="vllm", gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=False, max_model_len=model_len
    )
    gen = torch.Generator().manual_seed(0)
    vocab = min(150_000, dims["vocab_size"] - 1)
    prompts_ids = torch.randint(10, vocab, (max(args.batch, args.long_batch), 64), generator=gen).tolist()
    if args.interleave:
        save = lambda: out.write_text(json.dumps(results, indent=1))  # noqa: E731
        interleaved(args, results, rollout, (bf16_dir, fp8_dir), prompts_ids, save)
        print(f"wrote {out}", flush=True)
        return
    for variant in args.variants:
        recipe, served = variant_settings(variant, rollout)
        e = start_engine(variant, recipe, served, bf16_dir, fp8_dir)
        entry: dict[str, Any] = {"kernels": {} if ENGINE_PROCESS else kernel_names(e), "modes": {}, "long": {}}
        entry.update(
            engine_process=ENGINE_PROCESS, roofline=roofline(dims, variant, args.batch, 64, args.max_tokens, bw)
        )
        if args.long_tokens:
            entry["long_roofline"] = roofline(dims, variant, args.long_batch, 64, args.long_tokens, bw)
        results["variants"][variant] = entry
        try:
            measure(e, variant, args, prompts_ids, entry, save=lambda: out.write_text(json.dumps(results, indent=1)))
        except Exception as err:  # recorded, and the next variant still runs
            entry["error"] = repr(err)
            print(f"{variant} FAILED: {err!r}", flush=True)
        finally:
            e.close()
            free_gpu()
        out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
