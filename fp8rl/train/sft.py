"""Supervised warm-up of the tiny model on the synthetic task, so RL starts from non-trivial accuracy; the answer
batch every supervised warm-up trains on (this one and ``fp8rl.supervised``'s of a pretrained checkpoint)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fp8rl.config import OptimConfig
from fp8rl.evaluation import evaluate
from fp8rl.models.tiny import make_tiny_model
from fp8rl.rollout.torch_engine import TorchRolloutEngine
from fp8rl.tasks import ArithmeticTask, Example
from fp8rl.tasks.prompts import PromptFormat
from fp8rl.tracking.datasets import builtin_dataset
from fp8rl.train.batches import SequenceBatch
from fp8rl.train.trainer import TorchTrainer, TrainerOptions, build_batch

if TYPE_CHECKING:
    from fp8rl.tracking import MlflowSink

TRAIN_POOL = 20_000  # the training problems the batches are sampled from
STOP_WINDOW = 10  # the steps whose mean loss SFTOptions.stop_loss compares


@dataclass(frozen=True)
class SFTOptions:
    preset: str = "tiny"
    task: ArithmeticTask = field(default_factory=ArithmeticTask)
    steps: int = 600
    batch_size: int = 128
    lr: float = 3e-3
    seed: int = 0
    eval_examples: int = 200
    # Stop once the mean loss of the last STOP_WINDOW steps is at or below this (the learning-rate schedule stays
    # the one of ``steps``).  Where the warm-up ends on a fixed step count, its loss there depends on the machine:
    # the tiny model's loss drops from ~1.1 to ~0.4 within ~150 steps, and where in that drop step 600 falls
    # differs with the CPU's GEMM rounding.  A loss target gives every machine the same kind of start.
    stop_loss: float | None = None

    def cache_key(self) -> str:
        settings = {k: v for k, v in asdict(self).items() if not (k == "stop_loss" and v is None)}
        blob = json.dumps(settings, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def sft_warmup(
    out_dir: str | os.PathLike[str],
    opts: SFTOptions,
    log_every: int = 50,
    overwrite: bool = False,
    device: str = "cpu",
    sink: MlflowSink | None = None,
) -> dict[str, float]:
    """Train the tiny model on prompt -> answer + EOS (bf16, fp32 masters) and save it to ``out_dir``.

    With ``sink`` (an MLflow run) the options are its params, the loss every ``log_every`` steps and the
    held-out accuracy its metrics (``sft/...``), and the task's splits its dataset inputs."""
    torch.manual_seed(opts.seed)
    model, tok = make_tiny_model(opts.preset, seed=opts.seed)
    trainer = TorchTrainer(model, _trainer_options(opts), device=device)
    train = opts.task.examples("train", TRAIN_POOL)
    heldout = opts.task.examples("test", opts.eval_examples)
    if sink is not None:
        _log_inputs(sink, opts, train, heldout)
    t0 = time.perf_counter()
    metrics, step = _train(trainer, tok, train, opts, log_every, sink)
    trainer.save_checkpoint(out_dir, tok, overwrite=overwrite)
    engine = TorchRolloutEngine(out_dir, "bf16", device=device)
    result = evaluate(engine, tok, heldout)
    summary = {
        "sft_loss": metrics["sft_loss"],
        "steps": float(step),
        "heldout_accuracy": result["accuracy"],
        "seconds": time.perf_counter() - t0,
    }
    if sink is not None:
        sink.log_metrics({f"sft/{k}": v for k, v in summary.items()}, step=step)
    return summary


def _train(
    trainer: TorchTrainer, tok: Any, train: list[Example], opts: SFTOptions, log_every: int, sink: MlflowSink | None
) -> tuple[dict[str, float], int]:
    """The warm-up's steps, up to ``opts.steps`` or its loss target: (the last step's metrics, the steps run)."""
    rng = random.Random(opts.seed)
    t0 = time.perf_counter()
    metrics: dict[str, float] = {}
    recent: list[float] = []
    step = 0
    for step in range(1, opts.steps + 1):
        chunk = rng.sample(train, opts.batch_size)
        metrics = trainer.sft_step(answer_batch(tok, PromptFormat(), chunk, tok.eos_token_id, tok.pad_token_id))
        recent = [*recent[1 - STOP_WINDOW :], metrics["sft_loss"]]
        stop = opts.stop_loss is not None and len(recent) == STOP_WINDOW and sum(recent) / STOP_WINDOW <= opts.stop_loss
        if step % log_every == 0 or step == opts.steps or stop:
            if sink is not None:
                sink.log_metrics({"sft/loss": metrics["sft_loss"]}, step=step)
            print(
                f"sft step {step}/{opts.steps} loss {metrics['sft_loss']:.4f} ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
        if stop:
            print(f"sft: the mean loss of the last {STOP_WINDOW} steps is <= {opts.stop_loss}: stopped", flush=True)
            break
    return metrics, step


def _trainer_options(opts: SFTOptions) -> TrainerOptions:
    """BF16 with fp32 masters, the whole batch one micro-batch, a cosine schedule warming up over 5% of the steps."""
    optim = OptimConfig(lr=opts.lr, warmup_steps=opts.steps // 20, schedule="cosine", micro_batch_size=opts.batch_size)
    return TrainerOptions(total_steps=opts.steps, optim=optim)


def answer_ids(tokenizer: Any, fmt: PromptFormat, example: Example, eos_id: int) -> list[int]:
    """The target tokens of ``example``: its answer, then ``eos_id``.  Under a chat template the answer is the
    assistant turn's text; after raw prompt text it follows a space, as in running text, unless the prompt ends in
    whitespace or ``=`` (``3+4=`` is continued with ``7``)."""
    text = example.answer
    if not fmt.uses_template(tokenizer):
        prompt = fmt.text(example)
        text = text if not prompt or prompt[-1].isspace() or prompt.endswith("=") else " " + text
    return [*tokenizer(text, add_special_tokens=False).input_ids, eos_id]


def answer_batch(tokenizer: Any, fmt: PromptFormat, examples: list[Example], eos_id: int, pad_id: int) -> SequenceBatch:
    """Prompts (as the RL loop renders them) and their answers + eos, the answers right-padded and masked."""
    prompts = fmt.encode_all(tokenizer, examples)
    answers = [answer_ids(tokenizer, fmt, e, eos_id) for e in examples]
    width = max(len(a) for a in answers)
    resp = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width))
    for i, a in enumerate(answers):
        resp[i, : len(a)] = torch.tensor(a)
        mask[i, : len(a)] = 1
    return build_batch(prompts, resp, mask, pad_id)


def _log_inputs(sink: MlflowSink, opts: SFTOptions, train: list[Example], heldout: list[Example]) -> None:
    """The warm-up's options as params, and the task's splits as dataset inputs."""
    task_settings = asdict(opts.task)
    sink.log_params({"sft": {k: v for k, v in asdict(opts).items() if k != "task"}, "task": task_settings})
    sink.log_datasets([
        builtin_dataset("arithmetic", "train", "training", task_settings, train),
        builtin_dataset("arithmetic", "test", "evaluation", task_settings, heldout),
    ])  # fmt: skip
