"""Supervised warm-up of the tiny model on the synthetic task, so RL starts from non-trivial accuracy."""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field

import torch

from fp8rl.evaluation import evaluate
from fp8rl.models.tiny import make_tiny_model
from fp8rl.rollout.torch_engine import TorchRolloutEngine
from fp8rl.tasks import ArithmeticTask
from fp8rl.train.trainer import TorchTrainer, TrainerOptions, build_batch


@dataclass(frozen=True)
class SFTOptions:
    preset: str = "tiny"
    task: ArithmeticTask = field(default_factory=ArithmeticTask)
    steps: int = 600
    batch_size: int = 128
    lr: float = 3e-3
    seed: int = 0
    eval_examples: int = 200

    def cache_key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def sft_warmup(
    out_dir: str | os.PathLike[str],
    opts: SFTOptions,
    log_every: int = 50,
    overwrite: bool = False,
    device: str = "cpu",
) -> dict[str, float]:
    """Train the tiny model on prompt -> answer + EOS (bf16, fp32 masters) and save it to ``out_dir``."""
    torch.manual_seed(opts.seed)
    rng = random.Random(opts.seed)
    model, tok = make_tiny_model(opts.preset, seed=opts.seed)
    trainer = TorchTrainer(
        model,
        TrainerOptions(
            lr=opts.lr,
            total_steps=opts.steps,
            warmup_steps=opts.steps // 20,
            schedule="cosine",
            micro_batch_size=opts.batch_size,
        ),
        device=device,
    )
    train = opts.task.examples("train", 20_000)
    eos = tok.eos_token_id
    t0 = time.perf_counter()
    metrics: dict[str, float] = {}
    for step in range(1, opts.steps + 1):
        chunk = rng.sample(train, opts.batch_size)
        prompts = [tok(e.prompt).input_ids for e in chunk]
        answers = [[*tok(e.answer).input_ids, eos] for e in chunk]
        width = max(len(a) for a in answers)
        resp = torch.full((len(chunk), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width))
        for i, a in enumerate(answers):
            resp[i, : len(a)] = torch.tensor(a)
            mask[i, : len(a)] = 1
        metrics = trainer.sft_step(build_batch(prompts, resp, mask, tok.pad_token_id))
        if step % log_every == 0 or step == opts.steps:
            print(
                f"sft step {step}/{opts.steps} loss {metrics['sft_loss']:.4f} ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    trainer.save_checkpoint(out_dir, tok, overwrite=overwrite)
    engine = TorchRolloutEngine(out_dir, "bf16", device=device)
    result = evaluate(engine, tok, opts.task.examples("test", opts.eval_examples))
    return {
        "sft_loss": metrics["sft_loss"],
        "heldout_accuracy": result["accuracy"],
        "seconds": time.perf_counter() - t0,
    }
