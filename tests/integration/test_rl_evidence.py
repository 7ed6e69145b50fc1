"""The RL-core claims on the tiny task, 3 recipes x 3 seeds, with looser bounds than docs/rl.md's run.

docs/rl.md records the full run (200 steps, 64 prompts per step, avg@16); this test runs a shorter one (60 steps,
32 prompts, avg@8, the three seeds' RL from one SFT start at loss 0.6) so CI can afford it, and asserts:

- learning: for every recipe, held-out sampled accuracy (avg@k at the rollout temperature)
  after RL is above the SFT start, on average over the seeds;
- mismatch: the run-mean token_mult_prob_error orders bf16 <= fp8-e2e < fp8-rollout.  On CPU
  the engine and the trainer run the same numerics for bf16 and for fp8-e2e (the same
  quantization code, the same kernels), so the first two are 1 up to the last bit of a few
  CPU GEMMs whose blocking depends on the batch shape (seen: 1 + 1.5e-6), and only
  fp8-rollout, FP8 generation against BF16 training, shows a mismatch.

Why an SFT start at a loss target, not at a step count: the tiny model's SFT loss drops from ~1.1 to ~0.4 within
~150 steps, and where step 600 falls in that drop differs by machine (CPU GEMMs round differently): loss 0.58 and 0.66
on two machines, where 60 RL steps gained +1.7 to +3.3 points for every recipe and seed, but 0.41 on a third, whose
held-out problems RL then lost ground on (bf16 -0.9 to -1.6 points; a start past the drop, whose training problems
it already answered). Stopped
once its loss is <= 0.6 (step 435 there), the third machine's start gains +0.8 to +2.7 for every recipe and seed;
there, SFT seed 1 (loss 0.68 at step 600, no stop) gives mean gains of +0.9 (bf16), +0.5 (fp8-rollout), +0.6 (fp8-e2e).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fp8rl.config import RunConfig, load_recipe
from fp8rl.loop import run_rl
from fp8rl.tracking import MemorySink
from fp8rl.train.sft import SFTOptions, sft_warmup

SEEDS = (0, 1, 2)
RECIPES = ("bf16", "fp8-rollout", "fp8-e2e")


def _warm_up(model: Path, seed: int) -> Path:
    import torch

    torch.set_num_threads(1)  # one core per worker process: the runs are independent
    sft_warmup(model, SFTOptions(seed=seed, stop_loss=0.6), log_every=10_000)
    return model


def _run(model: Path, recipe: str, seed: int, work: Path) -> tuple[float, float]:
    """(sampled-accuracy gain over the SFT start, run-mean token_mult_prob_error) of one recipe and seed."""
    import torch

    torch.set_num_threads(1)
    cfg = RunConfig.model_validate(
        {
            "recipe": load_recipe(recipe),
            "seed": seed,
            "steps": 60,
            "eval_every": 60,
            "eval_samples": 8,
            "grpo": {"prompts_per_step": 32},
            "optim": {"lr": 1e-4, "warmup_steps": 10},
            "work_dir": str(work),
            "device": "cpu",
        }
    )
    result = run_rl(cfg, model, MemorySink(), log=lambda _s: None)
    gain = result.final["eval/sampled_accuracy"] - result.initial["eval/sampled_accuracy"]
    return gain, result.run_mean("mismatch/token_mult_prob_error")


@pytest.mark.slow
def test_rl_beats_the_sft_start_and_mismatch_orders_the_recipes(tmp_path: Path) -> None:
    """One SFT warm-up (seed 0), then the 9 runs from it, each in a worker process of its own (one per core: on 2
    cores about half the time of one after the other; every run is seeded, and its numbers do not depend on the
    order).  The seeds vary the RL runs: their prompts, samples and evaluation draws."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    workers = max(1, min(len(SEEDS), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        sft = pool.submit(_warm_up, tmp_path / "sft", 0).result()
        runs = {(r, s): pool.submit(_run, sft, r, s, tmp_path / f"{r}-{s}") for s in SEEDS for r in RECIPES}
        gains = {r: [runs[r, s].result()[0] for s in SEEDS] for r in RECIPES}
        tmpe = {r: [runs[r, s].result()[1] for s in SEEDS] for r in RECIPES}
    report = {r: (sum(gains[r]) / len(SEEDS), sum(tmpe[r]) / len(SEEDS)) for r in RECIPES}
    print(report)
    for recipe in RECIPES:
        assert report[recipe][0] > 0.0, f"{recipe}: sampled accuracy did not improve on average: {gains[recipe]}"
    assert report["bf16"][1] == pytest.approx(1.0, abs=1e-4)
    assert report["bf16"][1] <= report["fp8-e2e"][1] + 1e-4
    assert report["fp8-e2e"][1] < report["fp8-rollout"][1] - 1e-3
