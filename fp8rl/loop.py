"""The RL loop in one process: rollout -> reward -> training logprobs -> correction -> update -> requantized sync.

One step, for every recipe:
1. ``engine.generate`` samples ``group_size`` responses per prompt under ROLLOUT numerics
   and reports each sampled token's logprob from its own forward.
2. Rewards (exact match) and GRPO advantages per group.
3. The trainer recomputes the logprobs under TRAINING numerics; mismatch metrics compare
   the two, and the recipe's correction (TIS/MIS) weights or masks tokens.
4. One PPO-clip/GRPO optimizer step (fp32 masters).
5. The trainer's weights are requantized with the ROLLOUT recipe and loaded into the
   engine in place with the new policy version (verified bit for bit when asked).
6. Everything is logged to the metrics sink (MLflow in practice).
The Ray driver (issue 4) runs the same steps across actors.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from fp8rl.config import RunConfig
from fp8rl.evaluation import decode_responses, evaluate
from fp8rl.models.loading import load_tokenizer
from fp8rl.quant import QuantSpec
from fp8rl.rl import CorrectionConfig, PolicyLossConfig, grpo_advantages, mismatch_correction, mismatch_metrics
from fp8rl.rollout.base import SamplingParams
from fp8rl.rollout.torch_engine import TorchRolloutEngine
from fp8rl.sync import InProcessWeightSync
from fp8rl.tasks import ArithmeticTask, Example, exact_match_reward
from fp8rl.tracking import MetricsSink
from fp8rl.train.trainer import TorchTrainer, TrainerOptions, build_batch


@dataclass
class RLResult:
    recipe: str
    initial_accuracy: float
    final_accuracy: float
    history: list[dict[str, float]] = field(default_factory=list)

    def run_mean(self, metric: str) -> float:
        vals = [h[metric] for h in self.history if metric in h]
        return sum(vals) / len(vals) if vals else float("nan")


def quant_spec(cfg: RunConfig) -> QuantSpec:
    q = cfg.recipe.quant
    return QuantSpec(
        granularity=q.granularity,
        fmt=q.fmt,
        weight_block=q.weight_block,
        act_block=q.act_block,
        pow2_scales=q.pow2_scales,
    )


def correction_config(cfg: RunConfig) -> CorrectionConfig:
    c = cfg.recipe.correction
    return CorrectionConfig(**c.model_dump())


def loss_config(cfg: RunConfig) -> PolicyLossConfig:
    g = cfg.grpo
    return PolicyLossConfig(
        clip_low=g.clip_low, clip_high=g.clip_high, dual_clip=g.dual_clip, loss_agg=g.loss_agg, kl_coef=g.kl_coef
    )


@dataclass
class _Parts:
    """What one RL run holds: tokenizer, rollout engine, trainer and the sync between them."""

    tok: PreTrainedTokenizerBase
    engine: TorchRolloutEngine
    trainer: TorchTrainer
    sync: InProcessWeightSync
    bf16_bytes: int


def _build(cfg: RunConfig, model_dir: str | Path, device: str) -> _Parts:
    recipe, q, o = cfg.recipe, cfg.recipe.quant, cfg.optim
    spec = quant_spec(cfg)
    engine = TorchRolloutEngine(
        model_dir, recipe.rollout_precision, spec, q.bf16_first_layers, q.bf16_last_layers, device
    )
    opts = TrainerOptions(
        precision=recipe.train_precision,
        spec=spec,
        bf16_first_layers=q.bf16_first_layers,
        bf16_last_layers=q.bf16_last_layers,
        lr=o.lr,
        betas=o.betas,
        weight_decay=o.weight_decay,
        grad_clip=o.grad_clip,
        warmup_steps=o.warmup_steps,
        schedule=o.schedule,
        total_steps=cfg.steps,
        micro_batch_size=o.micro_batch_size,
    )
    trainer = TorchTrainer(model_dir, opts, device=device)
    sync = InProcessWeightSync(engine, {m + ".weight" for m in engine.fp8_modules}, spec, verify=cfg.verify_sync)
    bf16_bytes = sum(p.numel() * 2 for p in trainer.model.parameters())
    return _Parts(load_tokenizer(model_dir), engine, trainer, sync, bf16_bytes)


def _rl_step(cfg: RunConfig, parts: _Parts, examples: list[Example], step: int) -> dict[str, float]:
    """One RL step (module docstring, 1-5); returns its metrics."""
    tok, engine, trainer = parts.tok, parts.engine, parts.trainer
    g, temperature = cfg.grpo.group_size, cfg.sampling.temperature
    t0 = time.perf_counter()
    prompts = [tok(e.prompt).input_ids for e in examples for _ in range(g)]
    answers = [e.answer for e in examples for _ in range(g)]
    sampling = SamplingParams(
        temperature=temperature,
        top_p=cfg.sampling.top_p,
        top_k=cfg.sampling.top_k,
        max_tokens=cfg.sampling.max_tokens,
        seed=cfg.seed * 1_000_003 + step,
    )
    rollout = engine.generate(prompts, sampling)
    t1 = time.perf_counter()
    texts = decode_responses(tok, rollout)
    rewards = torch.tensor([exact_match_reward(t, a) for t, a in zip(texts, answers, strict=True)])
    adv = grpo_advantages(rewards, g, std_normalize=cfg.grpo.std_normalize, leave_one_out=cfg.grpo.leave_one_out)
    batch = build_batch(rollout.prompt_ids, rollout.response_ids, rollout.response_mask, engine.pad_token_id)
    old_lp = trainer.compute_logprobs(batch, temperature)
    t2 = time.perf_counter()
    mask = rollout.response_mask
    mm = mismatch_metrics(rollout.logprobs, old_lp, mask)
    weights, loss_mask, corr = mismatch_correction(old_lp, rollout.logprobs, mask, correction_config(cfg))
    train_m = trainer.policy_step(batch, adv, old_lp, weights, loss_mask, loss_config(cfg), temperature)
    t3 = time.perf_counter()
    stats = parts.sync.push(trainer.hf_state_dict(), version=step)
    t4 = time.perf_counter()
    tokens = float(mask.sum())
    return {
        "reward": float(rewards.mean()),
        "accuracy": float((rewards > 0).float().mean()),
        "response_length": tokens / len(prompts),
        **{f"mismatch/{k}": v for k, v in mm.items()},
        **{f"correction/{k}": v for k, v in corr.items()},
        **{f"train/{k}": v for k, v in train_m.items()},
        "sync/bytes": float(stats.bytes_sent),
        "sync/bytes_vs_bf16": stats.bytes_sent / parts.bf16_bytes,
        "sync/policy_version": float(engine.policy_version),
        "time/generate_s": t1 - t0,
        "time/logprob_s": t2 - t1,
        "time/train_s": t3 - t2,
        "time/sync_s": t4 - t3,
        "time/step_s": t4 - t0,
        "throughput/rollout_tokens_per_s": tokens / max(t1 - t0, 1e-9),
        "throughput/train_tokens_per_s": tokens / max(t3 - t1, 1e-9),
    }


def run_rl(
    cfg: RunConfig,
    model_dir: str | Path,
    sink: MetricsSink,
    task: ArithmeticTask | None = None,
    log: Callable[[str], None] = print,
    device: str = "cpu",
) -> RLResult:
    """Run ``cfg.steps`` RL steps from the checkpoint at ``model_dir``; metrics go to ``sink``."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    task = task or ArithmeticTask()
    name = cfg.recipe.name
    parts = _build(cfg, model_dir, device)
    train_pool: list[Example] = task.examples("train", 20_000)
    heldout = task.examples("test", cfg.eval_examples)
    max_tokens = cfg.sampling.max_tokens
    initial = evaluate(parts.engine, parts.tok, heldout, max_tokens)
    sink.log_metrics({"eval/accuracy": initial["accuracy"], "eval/response_tokens": initial["response_tokens"]}, step=0)
    log(f"[{name}] step 0 held-out accuracy {initial['accuracy']:.3f}")
    result = RLResult(name, initial["accuracy"], initial["accuracy"])
    for step in range(1, cfg.steps + 1):
        metrics = _rl_step(cfg, parts, rng.sample(train_pool, cfg.grpo.prompts_per_step), step)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            ev = evaluate(parts.engine, parts.tok, heldout, max_tokens)
            metrics["eval/accuracy"] = ev["accuracy"]
            metrics["eval/response_tokens"] = ev["response_tokens"]
            result.final_accuracy = ev["accuracy"]
        sink.log_metrics(metrics, step=step)
        result.history.append(metrics)
        log(
            f"[{name}] step {step}/{cfg.steps} reward {metrics['reward']:.3f} "
            f"loss {metrics['train/loss']:+.4f} tmpe {metrics['mismatch/token_mult_prob_error']:.5f} "
            + (f"eval {metrics['eval/accuracy']:.3f} " if "eval/accuracy" in metrics else "")
            + f"({metrics['time/step_s']:.1f}s)"
        )
    return result
