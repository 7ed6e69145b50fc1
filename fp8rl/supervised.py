"""Supervised warm-up of a pretrained checkpoint on a run config's task, so RL starts from a model that answers.

A pretrained (not instruction-tuned) model continues a question with more text instead of answering it: on a
verifiable task it scores near zero, few GRPO groups hold a reward that differs, and RL has nothing to amplify.
``sft_checkpoint`` fine-tunes it on the task's training split first:

- the input is each prompt exactly as the RL loop renders it (``task.chat_template``, ``task.system_prompt``:
  ``fp8rl.tasks.prompts``);
- the target is the example's reference answer, then the checkpoint's end-of-sequence id (the first stop id,
  ``fp8rl.models.special_tokens``): under a chat template the assistant turn's text, without one the answer after a
  space.  It teaches the answer's form and where to stop, not a worked solution;
- token-mean cross entropy on the target tokens (``TorchTrainer.sft_step``), BF16 with fp32 master weights, the run
  config's micro-batches and memory settings (``optim``), ``lr`` on a cosine schedule with a 5% warm-up;
- held-out accuracy (greedy, ``sampling.max_tokens``, the run's reward, ``eval_examples`` problems) before and after,
  and every ``eval_every`` steps, with the built-in engine in BF16; beside it the held-out answer loss (the same
  token-mean cross entropy on those problems' answers, teacher-forced).  The loss moves smoothly with what the model
  learned; greedy accuracy on a few dozen problems moves in steps of one problem, and where a small model's first
  correct answers appear depends on the CPU's or GPU's rounding.

The result is an ordinary HF checkpoint directory, written atomically, with ``fp8rl_sft.json`` beside the weights:
the options, the task, the loss and accuracy curve (what a later RL run started from).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fp8rl.atomic import atomic_directory
from fp8rl.build import prompt_format, reward_for, task_examples
from fp8rl.config import RunConfig
from fp8rl.errors import UserError
from fp8rl.evaluation import evaluate
from fp8rl.models.loading import load_tokenizer
from fp8rl.models.special_tokens import special_tokens
from fp8rl.rollout.torch_engine import TorchRolloutEngine
from fp8rl.tasks import Example
from fp8rl.train.sft import answer_batch
from fp8rl.train.trainer import SequenceBatch, TorchTrainer, TrainerOptions

SFT_RECORD = "fp8rl_sft.json"


@dataclass(frozen=True)
class SFTSettings:
    """The warm-up's own settings; the task, prompt format, reward and micro-batching come from the run config."""

    steps: int = 100
    batch_size: int = 32  # examples per optimizer step
    lr: float = 1e-5
    seed: int = 0  # the order the training examples are drawn in
    eval_every: int = 0  # held-out accuracy every N steps as well (0: before and after only)

    def check(self) -> None:
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise UserError(f"--lr must be > 0, got {self.lr}")
        if self.eval_every < 0:
            raise UserError(f"--eval-every must be >= 0, got {self.eval_every}")


def _heldout_accuracy(cfg: RunConfig, model: Any, tokenizer: Any, heldout: list[Example], device: str) -> float:
    """Greedy held-out accuracy of ``model`` (a checkpoint directory, or the trainer's module: left as it was found,
    in training mode with its parameters' ``requires_grad``) in BF16."""
    trainable = [p.requires_grad for p in model.parameters()] if isinstance(model, torch.nn.Module) else []
    engine = TorchRolloutEngine(model, "bf16", device=device)
    result = evaluate(
        engine, tokenizer, heldout, max_tokens=cfg.sampling.max_tokens, prompt_format=prompt_format(cfg),
        reward=reward_for(cfg),
    )  # fmt: skip
    if isinstance(model, torch.nn.Module):
        model.train()
        for p, flag in zip(model.parameters(), trainable, strict=True):
            p.requires_grad_(flag)
    return float(result["accuracy"])


def _heldout_loss(trainer: TorchTrainer, batch: SequenceBatch) -> float:
    """Token-mean cross entropy of the held-out answers (``batch``: ``answer_batch`` of the held-out problems) under
    the trainer's current weights, no update."""
    lp = trainer.compute_logprobs(batch, 1.0)
    return float(-(lp * batch.response_mask).sum() / batch.response_mask.sum().clamp(min=1))


def _record_heldout(record: dict[str, Any], step: int, accuracy: float, loss: float, label: str) -> None:
    """The held-out accuracy and answer loss at ``step`` into ``record``, and the progress line."""
    record["heldout_accuracy"].append([step, accuracy])
    record["heldout_loss"].append([step, loss])
    print(f"{label} {accuracy:.3f}, answer loss {loss:.4f}", flush=True)


def sft_checkpoint(
    cfg: RunConfig,
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    settings: SFTSettings,
    device: str = "cpu",
    overwrite: bool = False,
    log_every: int = 10,
) -> dict[str, Any]:
    """Fine-tune the checkpoint at ``model_dir`` on ``cfg.task`` (module docstring) and save it to ``out_dir``.

    Returns the record written to ``out_dir/fp8rl_sft.json``: ``settings``, ``task``, ``loss`` (``[step, loss]``
    every ``log_every`` steps), ``heldout_accuracy`` and ``heldout_loss`` (``[step, value]``, from step 0) and
    ``seconds``."""
    settings.check()
    if Path(out_dir).exists() and not overwrite:
        raise UserError(f"{out_dir} already exists (pass --overwrite to replace it)")
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    train, heldout = task_examples(cfg)
    tok, fmt = load_tokenizer(model_dir), prompt_format(cfg)
    tokens = special_tokens(model_dir, tok)
    optim = cfg.optim.model_copy(update={"lr": settings.lr, "warmup_steps": settings.steps // 20, "schedule": "cosine"})
    trainer = TorchTrainer(model_dir, TrainerOptions(total_steps=settings.steps, optim=optim), device=device)
    heldout_batch = answer_batch(tok, fmt, heldout, tokens.eos_id, tokens.pad_id)
    record: dict[str, Any] = {
        "settings": asdict(settings), "task": cfg.task.model_dump(mode="json"), "model": str(model_dir),
        "loss": [], "heldout_accuracy": [], "heldout_loss": [],
    }  # fmt: skip
    _record_heldout(record, 0, _heldout_accuracy(cfg, model_dir, tok, heldout, device),
                    _heldout_loss(trainer, heldout_batch), f"sft: {len(heldout)} held-out problems, accuracy at step 0")  # fmt: skip
    t0 = time.perf_counter()
    for step in range(1, settings.steps + 1):
        batch = answer_batch(tok, fmt, rng.sample(train, settings.batch_size), tokens.eos_id, tokens.pad_id)
        loss = trainer.sft_step(batch)["sft_loss"]
        if step % log_every == 0 or step == settings.steps:
            record["loss"].append([step, loss])
            print(f"sft step {step}/{settings.steps} loss {loss:.4f} ({time.perf_counter() - t0:.0f}s)", flush=True)
        if step == settings.steps or (settings.eval_every and step % settings.eval_every == 0):
            _record_heldout(record, step, _heldout_accuracy(cfg, trainer.model, tok, heldout, device),
                            _heldout_loss(trainer, heldout_batch), f"sft step {step}: held-out accuracy")  # fmt: skip
    record["seconds"] = time.perf_counter() - t0
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        trainer.save(tmp)
        tok.save_pretrained(tmp)
        (tmp / SFT_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return record
