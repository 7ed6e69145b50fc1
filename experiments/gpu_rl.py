"""The RL loop on a GPU: every recipe through the real FP8 GEMMs, side by side, same seeds.

Runs SFT warm-up then GRPO (docs/configs/rl-tiny.yaml) for bf16, fp8-rollout and fp8-e2e on
CUDA, seed after seed until the time budget is spent, and writes $OUT/gpu_rl.json after each
run: held-out accuracy before and after, run means of every mismatch metric, step timings.
Usage on the device: python3 experiments/gpu_rl.py [budget_seconds]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8rl.config import load_recipe, parse_run_config
from fp8rl.loop import run_rl
from fp8rl.quant import QuantSpec, fp8_gemm_backend, quantize_activation, quantize_weight
from fp8rl.tracking import MemorySink
from fp8rl.train.sft import SFTOptions, sft_warmup

SFT_STEPS = int(os.environ.get("SFT_STEPS", "600"))
MEAN_KEYS = [
    "mismatch/token_mult_prob_error",
    "mismatch/gen_kl",
    "mismatch/policy_kl",
    "mismatch/js_divergence",
    "mismatch/rollout_probs_diff_max",
    "reward",
    "time/step_s",
    "time/generate_s",
    "time/train_s",
    "time/sync_s",
    "sync/bytes_vs_bf16",
]


def _backend() -> str:
    """Which GEMM the block recipe's FP8 linears take on this GPU (cuBLAS scaled_mm, not emulation)."""
    spec = QuantSpec()
    x = quantize_activation(torch.randn(128, 128, device="cuda", dtype=torch.bfloat16), spec)
    w = quantize_weight(torch.randn(384, 128, device="cuda", dtype=torch.bfloat16), spec)
    return str(fp8_gemm_backend(x, w))


def main() -> None:
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 420.0
    out = Path(os.environ.get("OUT", "."))
    root = Path(__file__).resolve().parents[1]
    base = yaml.safe_load((root / "docs/configs/rl-tiny.yaml").read_text())
    t0 = time.perf_counter()
    summary: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "fp8_gemm_backend": _backend(),
        "config": base,
        "runs": [],
    }
    runs: list[dict[str, object]] = summary["runs"]  # type: ignore[assignment]
    for seed in [int(s) for s in os.environ.get("SEEDS", "0,1,2").split(",")]:
        model = Path(f"/tmp/fp8rl-gpu/sft-seed{seed}")
        if not model.exists():
            sft = sft_warmup(model, SFTOptions(seed=seed, steps=SFT_STEPS), log_every=300, device="cuda")
            print(
                f"seed {seed}: SFT held-out accuracy {sft['heldout_accuracy']:.3f} in {sft['seconds']:.0f}s", flush=True
            )
        for recipe in ["bf16", "fp8-rollout", "fp8-e2e"]:
            if time.perf_counter() - t0 > budget:
                break
            cfg = parse_run_config({**base, "recipe": load_recipe(recipe), "seed": seed, "work_dir": "/tmp/fp8rl-gpu"})
            start = time.perf_counter()
            res = run_rl(cfg, model, MemorySink(), log=lambda _s: None, device="cuda")
            runs.append(
                {
                    "recipe": recipe,
                    "seed": seed,
                    "initial": res.initial,
                    "final": res.final,
                    "run_mean": {k: res.run_mean(k) for k in MEAN_KEYS},
                    "seconds": time.perf_counter() - start,
                }
            )
            print(json.dumps(runs[-1]), flush=True)
            (out / "gpu_rl.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
