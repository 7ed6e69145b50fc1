"""The vLLM engine on a GPU (issue 7, section 2): one run, one JSON of results.

Sections (each catches its own failure, records it in the JSON and the run goes on):
  a  convert: the ``fp8rl convert`` checkpoint in vLLM vs the built-in torch FP8 engine (greedy agreement, logprob gap)
  b  reload: N in-place reloads of requantized weights (verified bit for bit) vs a fresh engine on the same weights
  c  rl: the RL loop with rollout.engine vllm, 3 steps each of bf16 / fp8-rollout / fp8-e2e
  d  sleep: colocated sleep/wake frees the memory and keeps the outputs
  e  kvfp8: FP8 KV cache calibrated from the trainer model vs the BF16 KV cache; the scales are live
  f  throughput: experiments/gpu_vllm_throughput.py (its own device call, one process per variant)

Usage on the device (vLLM on PYTHONPATH):
  python experiments/gpu_vllm.py                        # a-e, about 3 minutes on an H100
  python experiments/gpu_vllm_throughput.py --variants fp8   # f, about 2.5 minutes per variant
Writes $OUT/gpu_vllm.json after every section; what the GPU scripts share is in gpu_sections.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_sections import run_section, say, time_limit

from fp8rl.rollout.vllm_engine import VLLM_ENV_DEFAULTS

# set before anything imports vLLM: the engine's own defaults, and no network
for _key, _value in {**VLLM_ENV_DEFAULTS, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)

WORK = Path(os.environ.get("FP8RL_GPU_WORK", "/tmp/fp8rl-vllm"))
OUT = Path(os.environ.get("OUT", "."))
PROMPTS_N = 64


def section(results: dict[str, Any], name: str, limit_s: int, fn: Callable[[], dict[str, Any]], out: Path) -> None:
    """One section under a time limit (``gpu_sections.run_section``), then the GPU memory it left."""
    say(f"\n=== section {name} (limit {limit_s}s) ===")

    def limited() -> dict[str, Any]:
        with time_limit(limit_s):
            return fn()

    run_section(results, name, limited, out, say)
    free_gpu()


def free_gpu() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    print(f"GPU memory free after close: {free / 2**30:.2f} of {total / 2**30:.2f} GiB", flush=True)


def kernel_names(engine: Any) -> dict[str, str]:
    """Which kernels vLLM chose (internal attributes, read for diagnostics only)."""
    from fp8rl.rollout import vllm_patches

    out: dict[str, str] = {}
    try:
        model = vllm_patches.engine_model(engine.llm)
        for name, module in model.named_modules():
            if name.endswith("layers.1.self_attn.qkv_proj"):
                qm = getattr(module, "quant_method", None)
                out["qkv_quant_method"] = type(qm).__name__
                kernel = getattr(qm, "fp8_linear", None)
                out["qkv_kernel"] = type(kernel).__name__ if kernel is not None else "none"
            if name.endswith("layers.1.self_attn.attn"):
                out["attention_impl"] = type(getattr(module, "impl", None)).__name__
                out["kv_cache_dtype"] = str(getattr(module, "kv_cache_dtype", "?"))
    except Exception as e:
        out["error"] = repr(e)
    return out


# ---- shared fixtures -----------------------------------------------------------------------------------
def sft_model(steps: int) -> Path:
    """The small preset warmed up on the arithmetic task (peaked distributions make greedy comparisons meaningful)."""
    from fp8rl.train.sft import SFTOptions, sft_warmup

    path = WORK / f"sft-small-{steps}"
    if not path.exists():
        m = sft_warmup(path, SFTOptions(preset="small", steps=steps), log_every=max(steps // 2, 1), device="cuda")
        print(f"SFT small: held-out accuracy {m['heldout_accuracy']:.3f} in {m['seconds']:.0f}s", flush=True)
    return path


def prompts(model_dir: Path, n: int = PROMPTS_N) -> list[list[int]]:
    from fp8rl.models.loading import load_tokenizer
    from fp8rl.tasks import ArithmeticTask

    tok = load_tokenizer(model_dir)
    return [tok(e.prompt).input_ids for e in ArithmeticTask().examples("test", n)]


def compare(a: Any, b: Any) -> dict[str, Any]:
    """Greedy agreement of two rollouts: equal responses, first divergence, mean |logprob gap| on the common prefix."""
    equal, gaps, first_div = 0, [], []
    for i in range(a.response_ids.shape[0]):
        la, lb = int(a.response_mask[i].sum()), int(b.response_mask[i].sum())
        ta, tb = a.response_ids[i, :la].tolist(), b.response_ids[i, :lb].tolist()
        equal += ta == tb
        common = next((j for j, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(la, lb))
        first_div.append(common)
        gaps += (a.logprobs[i, :common] - b.logprobs[i, :common]).abs().tolist()
    n = a.response_ids.shape[0]
    return {
        "equal": equal,
        "n": n,
        "agreement": equal / n,
        "mean_abs_logprob_gap": sum(gaps) / max(len(gaps), 1),
        "max_abs_logprob_gap": max(gaps, default=0.0),
        "mean_first_divergence": sum(first_div) / n,
    }


def engine(model_dir: Path, recipe: Any, work: Path, **kw: Any) -> Any:
    from fp8rl.config import RolloutConfig
    from fp8rl.rollout.vllm_engine import VLLMRolloutEngine

    rollout = kw.pop("rollout", None) or RolloutConfig(
        engine="vllm", gpu_memory_utilization=0.06, enforce_eager=True, max_model_len=512
    )
    t0 = time.perf_counter()
    e = VLLMRolloutEngine(model_dir, recipe, rollout, work_dir=work, **kw)
    print(f"vLLM engine up in {time.perf_counter() - t0:.1f}s: {kernel_names(e)}", flush=True)
    return e


def perturbed(model_dir: Path, seed: int, scale: float = 0.05) -> dict[str, Any]:
    """The checkpoint's weights plus noise of ``scale`` x each tensor's mean |w| (a stand-in for training)."""
    import torch

    from fp8rl.models.loading import load_causal_lm

    model = load_causal_lm(model_dir, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        n: (p.detach() + scale * p.detach().abs().mean() * torch.randn(p.shape, generator=g, device="cuda")).to(
            torch.bfloat16
        )
        for n, p in model.named_parameters()
    }


# ---- sections a-e --------------------------------------------------------------------------------------
def section_convert(model_dir: Path) -> dict[str, Any]:
    from fp8rl.checkpoint.convert import ConvertOptions, convert_checkpoint
    from fp8rl.config import load_recipe
    from fp8rl.quant import QuantSpec
    from fp8rl.rollout import SamplingParams, TorchRolloutEngine

    dst = WORK / "small-fp8-block"
    if not dst.exists():
        convert_checkpoint(model_dir, dst, ConvertOptions(), show_progress=False)
    ps, greedy = prompts(model_dir), SamplingParams(temperature=0.0, max_tokens=16)
    torch_engine = TorchRolloutEngine(model_dir, "fp8", QuantSpec(), device="cuda")
    ref = torch_engine.generate(ps, greedy)
    del torch_engine
    e = engine(dst, load_recipe("fp8-rollout"), WORK / "a")
    try:
        out = e.generate(ps, greedy)
        diag = kernel_names(e)
    finally:
        e.close()
    result = {"vs_torch_fp8": compare(out, ref), "kernels": diag, "checkpoint": str(dst)}
    print(json.dumps(result["vs_torch_fp8"]), flush=True)
    return result


def section_reload(model_dir: Path, n_reloads: int = 5) -> dict[str, Any]:
    import torch

    from fp8rl.config import load_recipe
    from fp8rl.models.loading import load_causal_lm, load_tokenizer
    from fp8rl.rollout import SamplingParams
    from fp8rl.sync import InProcessSync

    ps, greedy = prompts(model_dir, 32), SamplingParams(temperature=0.0, max_tokens=24)
    recipe = load_recipe("fp8-rollout")
    e = engine(model_dir, recipe, WORK / "b")
    syncs = []
    try:
        before = e.generate(ps, greedy)  # fills the prefix cache with blocks of the old weights
        weights: dict[str, torch.Tensor] = {}
        sync = InProcessSync(e, lambda: weights, {m + ".weight" for m in e.fp8_modules}, e.spec, verify=True)
        for step in range(1, n_reloads + 1):
            weights = perturbed(model_dir, step)
            stats = sync.push(step)  # raises SyncVerificationError unless bit-exact
            syncs.append({"requantize_s": stats.requantize_seconds, "load_s": stats.load_seconds})
            reloaded = e.generate(ps, greedy)
        changed = compare(before, reloaded)["agreement"] < 1.0
    finally:
        e.close()
    final = WORK / "reloaded-final"
    model = load_causal_lm(model_dir, dtype=torch.bfloat16)
    model.load_state_dict({k: v.cpu() for k, v in weights.items()}, strict=False)
    model.save_pretrained(final)
    load_tokenizer(model_dir).save_pretrained(final)
    fresh_engine = engine(final, recipe, WORK / "b-fresh")
    try:
        fresh = fresh_engine.generate(ps, greedy)
    finally:
        fresh_engine.close()
    result = {
        "reloads": n_reloads,
        "verified_bit_exact": True,
        "outputs_changed_by_reload": changed,
        "vs_fresh_engine": compare(reloaded, fresh),
        "syncs": syncs,
    }
    print(json.dumps(result["vs_fresh_engine"]), flush=True)
    return result


def section_rl(model_dir: Path, steps: int = 3) -> dict[str, Any]:
    from fp8rl.build import build_parts
    from fp8rl.config import load_recipe, parse_run_config
    from fp8rl.loop import run_rl
    from fp8rl.tracking import MemorySink

    keys = ["reward", "mismatch/token_mult_prob_error", "mismatch/gen_kl", "time/generate_s", "time/sync_s",
            "time/step_s", "sync/bytes_vs_bf16", "sync/policy_version"]  # fmt: skip
    runs = {}
    for name in ["bf16", "fp8-rollout", "fp8-e2e"]:
        cfg = parse_run_config(
            {
                "recipe": load_recipe(name),
                "steps": steps,
                "eval_every": steps,
                "eval_examples": 32,
                "eval_samples": 0,
                "grpo": {"prompts_per_step": 8, "group_size": 4},
                "sampling": {"max_tokens": 8},
                "rollout": {
                    "engine": "vllm",
                    "gpu_memory_utilization": 0.06,
                    "enforce_eager": True,
                    "max_model_len": 512,
                },
                "work_dir": str(WORK / "rl"),
            }
        )
        t0 = time.perf_counter()
        parts = build_parts(cfg, model_dir, "cuda")
        try:
            res = run_rl(cfg, model_dir, MemorySink(), log=lambda s: print(s, flush=True), device="cuda", parts=parts)
        finally:
            parts.engine.close()  # type: ignore[attr-defined]
            del parts
            free_gpu()
        runs[name] = {
            "steps": [{k: h.get(k) for k in keys} for h in res.history],
            "initial": res.initial,
            "final": res.final,
            "seconds": time.perf_counter() - t0,
        }
    return {"runs": runs}


def section_sleep(model_dir: Path) -> dict[str, Any]:
    import torch

    from fp8rl.config import load_recipe
    from fp8rl.rollout import SamplingParams

    ps, greedy = prompts(model_dir, 16), SamplingParams(temperature=0.0, max_tokens=16)
    e = engine(model_dir, load_recipe("fp8-rollout"), WORK / "d", sleep_mode=True)
    try:
        before = e.generate(ps, greedy)
        free_awake = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        e.sleep()
        sleep_s = time.perf_counter() - t0
        free_asleep = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        e.wake_up()
        wake_s = time.perf_counter() - t0
        after = e.generate(ps, greedy)
    finally:
        e.close()
    return {
        "freed_gib": (free_asleep - free_awake) / 2**30,
        "sleep_s": sleep_s,
        "wake_s": wake_s,
        "outputs_after_wake": compare(before, after),
    }


def section_kv_fp8(model_dir: Path) -> dict[str, Any]:
    import torch

    from fp8rl.config import load_recipe
    from fp8rl.models.loading import load_causal_lm
    from fp8rl.rollout import KVScales, SamplingParams
    from fp8rl.train.trainer import build_batch

    ps, greedy = prompts(model_dir), SamplingParams(temperature=0.0, max_tokens=16)
    recipe = load_recipe("fp8-rollout")
    e = engine(model_dir, recipe, WORK / "e")
    try:
        bf16_kv = e.generate(ps, greedy)
    finally:
        e.close()
    trainer_model = load_causal_lm(model_dir, dtype=torch.bfloat16, device="cuda")
    batch = build_batch(bf16_kv.prompt_ids, bf16_kv.response_ids, bf16_kv.response_mask, 0)
    e = engine(model_dir, recipe.model_copy(update={"kv_cache": "fp8"}), WORK / "e")
    try:
        uncalibrated = e.generate(ps, greedy)
        metrics = e.calibrate_kv(trainer_model, batch.input_ids, batch.attention_mask, batch.position_ids)
        calibrated = e.generate(ps, greedy)
        good = dict(e.kv_scales)
        e.set_kv_scales({i: KVScales(s.q * 1e-3, s.k * 1e-3, s.v * 1e-3) for i, s in good.items()})
        e.llm.reset_prefix_cache()
        crushed = e.generate(ps, greedy)
        e.set_kv_scales(good)
        e.llm.reset_prefix_cache()
        restored = e.generate(ps, greedy)
        diag = kernel_names(e)
    finally:
        e.close()
    return {
        "kv_metrics": metrics,
        "scales": {i: [s.q, s.k, s.v] for i, s in good.items()},
        "calibrated_vs_bf16_kv": compare(calibrated, bf16_kv),
        "uncalibrated_vs_bf16_kv": compare(uncalibrated, bf16_kv),
        "scales_are_live": compare(crushed, calibrated)["agreement"] < 1.0,
        "restored_vs_calibrated": compare(restored, calibrated),
        "kernels": diag,
    }


def start_report() -> dict[str, Any]:
    """The results of one run: versions and device, printed and kept; the sections are added as they run."""
    import torch

    OUT.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"argv": sys.argv, "torch": torch.__version__, "sections": {}}
    try:
        import vllm

        results["vllm"] = vllm.__version__
    except Exception as e:
        results["vllm"] = f"not importable: {e!r}"
    results["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    print(json.dumps({k: results[k] for k in ("torch", "vllm", "device")}), flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--section", default="all", help="all (a-e), or one of convert,reload,rl,sleep,kvfp8")
    p.add_argument("--sft-steps", type=int, default=300)
    args = p.parse_args()
    results = start_report()
    out = OUT / "gpu_vllm.json"
    model: dict[str, Path] = {}

    def prepare() -> dict[str, Any]:
        model["dir"] = sft_model(args.sft_steps)
        return {"model": str(model["dir"])}

    section(results, "prepare", 120, prepare, out)
    if "dir" not in model:
        return
    m = model["dir"]
    sections = {
        "convert": (60, lambda: section_convert(m)),
        "reload": (90, lambda: section_reload(m)),
        "rl": (150, lambda: section_rl(m)),
        "sleep": (45, lambda: section_sleep(m)),
        "kvfp8": (60, lambda: section_kv_fp8(m)),
    }
    for name, (limit, fn) in sections.items():
        if args.section in ("all", name):
            section(results, name, limit, fn, out)
    failed = [n for n, s in results["sections"].items() if s["status"] != "ok"]
    print(f"\nsections failed: {failed or 'none'}; results in {out}", flush=True)


if __name__ == "__main__":
    main()
