"""The TransformerEngine training backend on a GPU: environment, consistency with fp8rl.quant, RL loop, throughput.

Sections (each catches its own failure, records it in the JSON and the next one runs; each
has a time budget and skips what does not fit):
  env          TE / torch / cuDNN versions, FP8 and block-scaling support, the TE recipes the
               fp8rl recipes build (with their effective pow2 flags), and which token counts a
               block / current-scaling te.Linear accepts (TOKEN_ALIGN in fp8rl.train.te_trainer).
  consistency  FP8 bytes and scales of TE's block quantizers (built from the recipe through TE's
               RecipeState) vs fp8rl.quant, for weights (128x128), activations and gradients
               (1x128), random and the 'small' tiny model's weights and activations, FP32 and pow2
               scales: exact-match fraction of the bytes, max scale difference.
  logprobs     teacher-forced per-token logprobs on the same weights and sequences from the te
               trainer (FP8 and BF16), the torch trainer (FP8 and BF16) and the torch FP8 rollout
               engine, plus the engine's own sampled logprobs: token_mult_prob_error of each pair.
  rl           fp8rl.loop.run_rl with trainer te for block / current / delayed scaling (and the
               torch trainer for reference), a few steps on the 'small' tiny model.
  throughput   training tokens/s of te / torch, FP8 / BF16 on 1.5B- and 8B-shaped layers   (gpu_te_speed.py)
  gemm         one linear's forward+backward time and host enqueue time                  (gpu_te_speed.py)
  vllm         if vLLM and fp8rl.rollout.vllm_engine import: vLLM FP8 rollout logprobs vs the
               te and torch FP8 trainers on vLLM's sequences.
Writes $OUT/gpu_te.json after every section (OUT defaults to '.'), and readable lines.

Usage on the GPU machine (docs/te.md for the cuDNN environment TE needs before Python starts):
    PYTHONPATH=/tmp/site python3 experiments/gpu_te.py [--budget 420] [--only env,consistency]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_sections import Deadline, run_section, say, short_error
from gpu_te_speed import GRANS, make_trainer, opts, section_gemm, section_throughput, spec_for

from fp8rl.config import OptimConfig
from fp8rl.quant import QuantSpec, quantize_activation, quantize_weight
from fp8rl.rl import mismatch_metrics
from fp8rl.train.te_recipes import te_recipe_for
from fp8rl.train.trainer import SequenceBatch, TorchTrainer, TrainerOptions, build_batch

SECTIONS = ("env", "consistency", "logprobs", "rl", "throughput", "gemm", "vllm")
BUDGETS = {"env": 30, "consistency": 40, "logprobs": 40, "rl": 100, "throughput": 150, "gemm": 40, "vllm": 120}


def tiny_model(root: Path, preset: str = "small") -> Path:
    from fp8rl.models import save_tiny_model

    dst = root / preset
    return dst if dst.exists() else save_tiny_model(dst, preset, seed=0)


def warm_model(root: Path, steps: int = 1200) -> Path:
    """The tiny preset after SFT on the arithmetic task: rewards vary within groups, so RL steps have gradients."""
    from fp8rl.train.sft import SFTOptions, sft_warmup

    dst = root / f"sft-tiny-{steps}"
    if not dst.exists():
        m = sft_warmup(dst, SFTOptions(preset="tiny", steps=steps), log_every=steps, device="cuda")
        say(f"[rl] SFT tiny {steps} steps: held-out accuracy {m['heldout_accuracy']:.3f} in {m['seconds']:.0f}s")
    return dst


# ---- env ---------------------------------------------------------------------------------------------------
def section_env(d: Deadline, root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch_cudnn": torch.backends.cudnn.version(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("NVTE_", "CUDNN")) or k == "LD_LIBRARY_PATH"},
    }
    import transformer_engine
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe

    from fp8rl.train.te_trainer import QPARAM_ATTRS, build_te_recipe

    out["te"] = transformer_engine.__version__
    out["te_cudnn"] = str(te.get_cudnn_version())
    out["fp8"] = list(te.is_fp8_available(return_reason=True))
    out["fp8_block"] = list(te.is_fp8_block_scaling_available(return_reason=True))
    out["mxfp8"] = list(te.is_mxfp8_available(return_reason=True))
    out["class_default_block_pow2"] = te_recipe.Float8BlockScaling.fp8_quant_fwd_weight.power_2_scale
    recipes = {}
    for kind, pow2 in [("block", False), ("block", True), ("current", False), ("current", True), ("delayed", False)]:
        desc = te_recipe_for(*spec_for(kind, pow2))
        r = build_te_recipe(desc)
        recipes[f"{kind}{'-pow2' if pow2 else ''}"] = {
            "desc": desc.describe(),
            "recipe": repr(r).replace("\n", " "),
            "qparams_pow2": {a: getattr(r, a).power_2_scale for a in QPARAM_ATTRS if hasattr(r, a)},
        }
    out["recipes"] = recipes
    say(f"[env] TE {out['te']} torch {out['torch']} {out['device']} fp8 {out['fp8']} block {out['fp8_block']}")
    out["token_alignment"] = probe_token_alignment(te, build_te_recipe)
    say(f"[env] te.Linear(256->256) fwd+bwd by token count: {out['token_alignment']}")
    return out


def probe_token_alignment(te: Any, build: Callable[..., Any]) -> dict[str, dict[int, str]]:
    res: dict[str, dict[int, str]] = {}
    for kind in ("block", "current"):
        recipe = build(te_recipe_for(*spec_for(kind)))
        lin = te.Linear(256, 256, bias=False, params_dtype=torch.bfloat16, device="cuda")
        res[kind] = {}
        for m in (4, 8, 16, 48, 128, 200, 264):
            x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            try:
                with te.autocast(enabled=True, recipe=recipe):
                    y = lin(x)
                y.float().sum().backward()
                torch.cuda.synchronize()
                res[kind][m] = "ok"
            except Exception as e:
                res[kind][m] = f"{type(e).__name__}: {str(e)[:160]}"
    return res


# ---- consistency -------------------------------------------------------------------------------------------
def section_consistency(d: Deadline, root: Path) -> dict[str, Any]:
    from fp8rl.train.te_trainer import (
        build_te_recipe,
        quantization_agreement,
        te_block_quantizers,
        te_quantize_as_fp8rl,
    )

    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    wide = rnd(2048, 2048) * torch.logspace(-4, 3, 2048, device="cuda").to(torch.bfloat16)
    tensors: dict[str, tuple[str, torch.Tensor]] = {
        "weight_4096x4096": ("weight", rnd(4096, 4096, scale=0.02)),
        "weight_1000x3000": ("weight", rnd(1000, 3000, scale=0.02)),
        "weight_wide_range": ("weight", wide),
        "act_4096x4096": ("input", rnd(4096, 4096)),
        "act_wide_range": ("input", wide),
        "act_300x1000": ("input", rnd(300, 1000, scale=3.0)),
        "grad_4096x4096": ("grad_output", rnd(4096, 4096, scale=1e-4)),
    }
    tensors.update(tiny_model_tensors(tiny_model(root)))
    out: dict[str, Any] = {}
    for pow2 in (False, True):
        spec = QuantSpec(pow2_scales=pow2)
        quantizers = te_block_quantizers(build_te_recipe(te_recipe_for(spec)))
        flags = {k: (q.force_pow_2_scales, q.block_scaling_dim, q.amax_epsilon) for k, q in quantizers.items()}
        rows = {}
        for name, (role, x) in tensors.items():
            if d.out():
                rows[name] = "skipped: time"
                continue
            try:
                ours = (quantize_weight if role == "weight" else quantize_activation)(x, spec)
                rows[name] = quantization_agreement(ours, te_quantize_as_fp8rl(quantizers[role], x))
            except Exception as e:
                rows[name] = {"status": "failed", "shape": list(x.shape), **short_error(e)}
        done = [r for r in rows.values() if isinstance(r, dict) and "bytes_exact_fraction" in r]
        if not done:
            raise RuntimeError(f"no tensor compared: {rows}")
        key = "pow2" if pow2 else "fp32_scales"
        out[key] = {
            "quantizer_flags(pow2, dim, eps)": flags,
            "min_bytes_exact_fraction": min(r["bytes_exact_fraction"] for r in done),
            "max_scale_rel_diff": max(r["scale_max_rel_diff"] for r in done),
            "max_scale_abs_diff": max(r["scale_max_abs_diff"] for r in done),
            "tensors": rows,
        }
        say(f"[consistency] {key}: bytes exact >= {out[key]['min_bytes_exact_fraction']:.6f}, "
            f"max scale rel diff {out[key]['max_scale_rel_diff']:.3g} over {len(done)} tensors")  # fmt: skip
    return out


def tiny_model_tensors(model_dir: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """Every FP8 linear's weight of the 'small' tiny model, and the inputs those linears see on a batch."""
    t = TorchTrainer(
        model_dir, TrainerOptions(precision="bf16", optim=OptimConfig(lr=2e-5, warmup_steps=0)), device="cuda"
    )
    from fp8rl.models.layers import fp8_module_names

    names = fp8_module_names(t.model)
    out: dict[str, tuple[str, torch.Tensor]] = {}
    hooks = []
    for n in names:
        lin = t.model.get_submodule(n)
        out[f"tiny:{n}.weight"] = ("weight", lin.weight.detach().clone())
        hooks.append(lin.register_forward_hook(lambda m, i, o, n=n: out.__setitem__(f"tiny:{n}.input", ("input", i[0].detach().reshape(-1, i[0].shape[-1]).clone()))))  # fmt: skip
    ids = torch.randint(5, 90, (8, 64), device="cuda")
    with torch.no_grad():
        t.model(input_ids=ids)
    for h in hooks:
        h.remove()
    return out


# ---- logprobs ----------------------------------------------------------------------------------------------
@torch.no_grad()
def teacher_forced(model: Any, b: SequenceBatch) -> torch.Tensor:
    """Per-token logprobs of the response tokens of ``b`` under ``model``'s forward (temperature 1)."""
    ids = b.input_ids.cuda()
    logits = model(input_ids=ids, attention_mask=b.attention_mask.cuda(), position_ids=b.position_ids.cuda()).logits
    t = ids.shape[1] - b.prompt_width
    lp = logits[:, b.prompt_width - 1 : b.prompt_width - 1 + t].float().log_softmax(-1)
    return (lp.gather(-1, ids[:, b.prompt_width :, None]).squeeze(-1) * b.response_mask.cuda()).cpu()


def tmpe_pairs(lps: dict[str, torch.Tensor], mask: torch.Tensor, pairs: list[tuple[str, str]]) -> dict[str, float]:
    return {
        f"{a} vs {b}": mismatch_metrics(lps[a], lps[b], mask)["token_mult_prob_error"]
        for a, b in pairs
        if a in lps and b in lps
    }


def section_logprobs(d: Deadline, root: Path) -> dict[str, Any]:
    from fp8rl.rollout import SamplingParams, TorchRolloutEngine

    model_dir = tiny_model(root)
    prompts = [[5 + (i * 7 + j) % 80 for j in range(3 + i % 9)] for i in range(48)]
    out: dict[str, Any] = {}
    for kind in ("block", "current"):
        if d.out():
            out[kind] = "skipped: time"
            continue
        spec, _ = spec_for(kind)
        engine = TorchRolloutEngine(model_dir, "fp8", spec, device="cuda")
        r = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24, seed=0))
        batch = build_batch(r.prompt_ids, r.response_ids, r.response_mask, engine.pad_token_id)
        lps = {"engine_sampled": r.logprobs, "engine_teacher_forced": teacher_forced(engine.model, batch)}
        del engine
        for name, o in [("te_fp8", opts("fp8", kind)), ("torch_fp8", opts("fp8", kind, "torch")),
                        ("te_bf16", opts("bf16")), ("torch_bf16", opts("bf16", backend="torch"))]:  # fmt: skip
            try:
                lps[name] = make_trainer(model_dir, o).compute_logprobs(batch, 1.0)
            except Exception as e:
                out.setdefault("errors", {})[f"{kind}:{name}"] = short_error(e)
        torch.cuda.empty_cache()
        pairs = [("engine_sampled", x) for x in ("engine_teacher_forced", "te_fp8", "torch_fp8", "te_bf16")]
        pairs += [("engine_teacher_forced", "te_fp8"), ("engine_teacher_forced", "torch_fp8"), ("te_fp8", "torch_fp8"),
                  ("te_bf16", "torch_bf16"), ("te_fp8", "te_bf16"), ("torch_fp8", "torch_bf16")]  # fmt: skip
        out[kind] = {
            "tokens": float(r.response_mask.sum()),
            "token_mult_prob_error": tmpe_pairs(lps, r.response_mask, pairs),
        }
        for k, v in out[kind]["token_mult_prob_error"].items():
            say(f"[logprobs] {kind}: tmpe {k}: {v:.6f}")
    return out


# ---- rl ----------------------------------------------------------------------------------------------------
def section_rl(d: Deadline, root: Path, steps: int) -> dict[str, Any]:
    from fp8rl.config import load_recipe, parse_recipe, parse_run_config
    from fp8rl.loop import run_rl
    from fp8rl.tracking import NullSink

    model_dir = warm_model(root)
    out: dict[str, Any] = {}
    for kind, trainer in [("block", "te"), ("current", "te"), ("delayed", "te"), ("block", "torch")]:
        name = f"{trainer}-{kind}"
        if d.out():
            out[name] = "skipped: time"
            continue
        gran, te_recipe = GRANS[kind]
        recipe = load_recipe("fp8-e2e").model_dump()
        recipe.update(name=name, trainer=trainer, te_recipe=te_recipe if trainer == "te" else "auto")
        recipe["quant"] = {**recipe["quant"], "granularity": gran}
        cfg = parse_run_config({
            "recipe": parse_recipe(recipe), "steps": steps, "eval_every": steps, "eval_examples": 16, "eval_samples": 0,
            "grpo": {"group_size": 8, "prompts_per_step": 16}, "sampling": {"max_tokens": 8},
            "optim": {"warmup_steps": 0, "micro_batch_size": 32}, "work_dir": str(root / "rl"),
        })  # fmt: skip
        try:
            t0 = time.perf_counter()
            res = run_rl(cfg, model_dir, NullSink(), log=lambda s: say(f"[rl] {s}"), device="cuda")
            keys = (
                "train/loss",
                "mismatch/token_mult_prob_error",
                "reward",
                "train/grad_norm",
                "time/step_s",
                "time/train_s",
                "time/logprob_s",
            )
            out[name] = {
                "seconds": time.perf_counter() - t0,
                "steps": [{k: h.get(k) for k in keys} for h in res.history],
                "initial_eval": res.initial,
                "final_eval": res.final,
                "finite": all(all(isinstance(h.get(k), float) and h[k] == h[k] for k in keys[:2]) for h in res.history),
            }
        except Exception as e:
            out[name] = {"status": "failed", **short_error(e)}
            say(f"[rl] {name} FAILED: {out[name]['error']}")
        torch.cuda.empty_cache()
    return out


# ---- vllm --------------------------------------------------------------------------------------------------
def section_vllm(d: Deadline, root: Path) -> dict[str, Any]:
    try:
        import vllm  # noqa: F401

        from fp8rl.rollout.vllm_engine import VLLMRolloutEngine
    except ImportError as e:
        return {"status": "skipped", "reason": f"vLLM engine not importable: {e}"}
    from fp8rl.config import load_recipe, parse_run_config
    from fp8rl.rollout import SamplingParams

    model_dir = tiny_model(root)
    cfg = parse_run_config(
        {
            "recipe": load_recipe("fp8-e2e"),
            "rollout": {"engine": "vllm", "gpu_memory_utilization": 0.3, "enforce_eager": True},
        }
    )
    engine = VLLMRolloutEngine.from_run_config(cfg, model_dir, "cuda")
    prompts = [[5 + (i * 7 + j) % 80 for j in range(3 + i % 9)] for i in range(48)]
    try:
        r = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24, seed=0))
    finally:
        engine.close()
    batch = build_batch(r.prompt_ids, r.response_ids, r.response_mask, engine.pad_token_id)
    lps = {"vllm": r.logprobs}
    for name, o in [("te_fp8", opts("fp8")), ("torch_fp8", opts("fp8", backend="torch")), ("te_bf16", opts("bf16"))]:
        lps[name] = make_trainer(model_dir, o).compute_logprobs(batch, 1.0)
    pairs = [("vllm", "te_fp8"), ("vllm", "torch_fp8"), ("vllm", "te_bf16"), ("te_fp8", "torch_fp8")]
    res = {"tokens": float(r.response_mask.sum()), "token_mult_prob_error": tmpe_pairs(lps, r.response_mask, pairs)}
    for k, v in res["token_mult_prob_error"].items():
        say(f"[vllm] tmpe {k}: {v:.6f}")
    return res


# ---- driver ------------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run (sections scale to it)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--rl-steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=4, help="decoder layers in the throughput stacks")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps per throughput backend (median)")
    a = p.parse_args()
    only = [s for s in a.only.split(",") if s]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        sys.exit("gpu_te.py needs a CUDA GPU")
    root = Path(tempfile.mkdtemp(prefix="fp8rl-te-"))
    scale = a.budget / sum(BUDGETS.values())
    runners: dict[str, Callable[[Deadline], dict[str, Any]]] = {
        "env": lambda d: section_env(d, root),
        "consistency": lambda d: section_consistency(d, root),
        "logprobs": lambda d: section_logprobs(d, root),
        "rl": lambda d: section_rl(d, root, a.rl_steps),
        "throughput": lambda d: section_throughput(d, root, a),
        "gemm": lambda d: section_gemm(d, root),
        "vllm": lambda d: section_vllm(d, root),
    }
    report: dict[str, Any] = {"args": vars(a), "sections": {}}
    for name in SECTIONS:
        if name in only:
            run_section(
                report, name, partial(runners[name], Deadline(BUDGETS[name] * scale)), out_dir / "gpu_te.json", say
            )
    say(f"wrote {out_dir / 'gpu_te.json'}")


if __name__ == "__main__":
    main()
