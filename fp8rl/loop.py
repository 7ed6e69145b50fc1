"""The RL loop in one process: rollout -> reward -> training logprobs -> correction -> update -> requantized sync.

One step, for every recipe:
1. ``engine.generate`` samples ``group_size`` responses per prompt under ROLLOUT numerics
   and reports each sampled token's logprob from its own forward.
2. Rewards (exact match) and GRPO advantages per group.
3. The trainer computes the logprobs under TRAINING numerics; mismatch metrics compare
   the two, and the recipe's correction (TIS/MIS) weights or masks tokens.
4. One PPO-clip/GRPO optimizer step (fp32 masters).  3 happens inside 4's forwards, micro-batch
   by micro-batch (``grpo.old_logprobs: train_forward``, ``fp8rl.train.old_logprobs``), or in a
   forward of its own before it (``recompute``).
5. The trainer's weights are requantized with the ROLLOUT recipe and loaded into the
   engine in place with the new policy version (verified bit for bit when asked).
6. Everything is logged to the metrics sink (MLflow in practice).
The Ray driver runs the same steps across actors; the parts of both are built in ``fp8rl.build``.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from fp8rl.build import build_parts, prompt_format, reward_for, task_examples
from fp8rl.config import (
    RunConfig,
)
from fp8rl.errors import UserError
from fp8rl.evaluation import decode_responses, evaluate
from fp8rl.rl import grpo_advantages, mismatch_correction, mismatch_metrics
from fp8rl.rollout.base import RolloutGenerator, SamplingParams
from fp8rl.rollout.kv_calibration import calibration_rows
from fp8rl.run_state import (
    LoopState,
    MetricsBuffer,
    load_latest,
    restore_python_rng,
    save_loop_state,
)
from fp8rl.sync import SyncStats
from fp8rl.tasks import Example
from fp8rl.tracking import MetricsSink
from fp8rl.train.old_logprobs import CORRECTION, MISMATCH, PolicyStep, RecomputedOld, TrainForwardOld, ess_metric
from fp8rl.train.trainer import SequenceBatch, build_batch


@dataclass
class RLResult:
    """Held-out evaluation before the first and after the last step (``eval/...`` keys), and every step's metrics."""

    recipe: str
    initial: dict[str, float]
    final: dict[str, float]
    history: list[dict[str, float]] = field(default_factory=list)

    @property
    def initial_accuracy(self) -> float:
        return self.initial["eval/accuracy"]

    @property
    def final_accuracy(self) -> float:
        return self.final["eval/accuracy"]

    def run_mean(self, metric: str) -> float:
        vals = [h[metric] for h in self.history if metric in h]
        return sum(vals) / len(vals) if vals else float("nan")


class Parts(Protocol):
    """What one RL run drives: a tokenizer, a rollout side, a training side and the sync between them.

    ``LocalParts`` holds them in this process; ``fp8rl.cluster`` holds them in Ray actors behind
    the same methods, so ``rl_step`` computes the same thing either way.
    """

    tok: PreTrainedTokenizerBase
    bf16_bytes: int
    # how many linears the engine and the trainer hold in FP8 (fp8rl.fp8_coverage), checked before the first step
    fp8_linears: dict[str, int]

    @property
    def engine(self) -> RolloutGenerator: ...

    @property
    def trainer(self) -> PolicyTrainer: ...

    def push_weights(self, version: int) -> SyncStats:
        """Requantize the trainer's weights with the rollout recipe and load them into the engine(s)."""
        ...

    def save_policy(self, output_dir: str | Path) -> None: ...

    def calibrate_kv(self, batch: SequenceBatch) -> dict[str, float]:
        """Recalibrate the engine's FP8 KV-cache scales from the trainer's policy on ``batch``; returns
        ``kv/...`` metrics, ``{}`` when the recipe keeps a bf16 KV cache."""
        ...


class PolicyTrainer(Protocol):
    def compute_logprobs(self, batch: SequenceBatch, temperature: float) -> torch.Tensor: ...

    def policy_step(self, step: PolicyStep) -> dict[str, float]:
        """One optimizer step over ``step.batch`` (``fp8rl.train.old_logprobs.PolicyStep``)."""
        ...

    def profile_next_policy_step(self) -> None:
        """The next policy step's metrics add its kernel time by category (``fp8rl.train.step_profile``)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def step_sampling(cfg: RunConfig, step: int) -> SamplingParams:
    """``cfg.sampling`` for ``step``: a seed of its own each step (the engines derive one per request from it)."""
    s = cfg.sampling
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_tokens=s.max_tokens,
        seed=cfg.seed * 1_000_003 + step,
        ignore_eos=s.ignore_eos,
    )


def recalibrate_kv(cfg: RunConfig, parts: Parts, batch: SequenceBatch) -> dict[str, float]:
    """FP8 KV cache: scales for the new weights, from the trainer's activations on (a budget of) this batch; its
    metrics, or nothing where the cache has no scales to calibrate."""
    rows = calibration_rows(batch.attention_mask, cfg.rollout.kv_calibration_tokens)
    kv = parts.calibrate_kv(batch.slice(rows))
    if kv and rows.step is not None:
        kv["kv/calibration_tokens"] = float(batch.attention_mask[rows].sum())
    return kv


def rl_step(cfg: RunConfig, parts: Parts, examples: list[Example], step: int) -> dict[str, float]:
    """One RL step (module docstring, 1-5); returns its metrics."""
    tok, engine, trainer = parts.tok, parts.engine, parts.trainer
    g = cfg.grpo.group_size
    t0 = time.perf_counter()
    items = [e for e in examples for _ in range(g)]
    prompts = prompt_format(cfg).encode_all(tok, items)
    rollout = engine.generate(prompts, step_sampling(cfg, step))
    t1 = time.perf_counter()
    texts = decode_responses(tok, rollout)
    scored = reward_for(cfg).score(texts, items)
    if scored.first_error:
        print(f"[{cfg.recipe.name}] step {step}: reward {scored.first_error}", file=sys.stderr)
    rewards = torch.tensor(scored.rewards)
    adv = grpo_advantages(rewards, g, std_normalize=cfg.grpo.std_normalize, leave_one_out=cfg.grpo.leave_one_out)
    batch = build_batch(rollout.prompt_ids, rollout.response_ids, rollout.response_mask, engine.pad_token_id)
    t_scored = time.perf_counter()  # decode, rewards, advantages and the batch are the step's idle time
    mask = rollout.response_mask
    train_m, mm, corr, t2 = _policy_update(cfg, trainer, batch, adv, rollout, t_scored)
    t3 = time.perf_counter()
    stats = parts.push_weights(step)
    t_pushed = time.perf_counter()
    kv = recalibrate_kv(cfg, parts, batch)
    t4 = time.perf_counter()
    tokens = float(mask.sum())
    freed = getattr(engine, "sleep_freed_bytes", None)  # colocated vLLM on Ray: what sleeping gave to training
    return {
        **({"memory/rollout_sleep_freed_gb": freed / 2**30} if freed is not None else {}),
        "reward": float(rewards.mean()),
        **scored.metrics(),
        "accuracy": float((rewards > 0).float().mean()),
        "response_length": tokens / len(prompts),
        **{f"mismatch/{k}": v for k, v in mm.items()},
        **{f"correction/{k}": v for k, v in corr.items()},
        **{f"train/{k}": v for k, v in train_m.items()},
        **kv,
        "sync/bytes": float(stats.bytes_sent),
        "sync/bytes_vs_bf16": stats.bytes_sent / parts.bf16_bytes,
        "sync/policy_version": float(engine.policy_version),
        **_step_times((t0, t1, t_scored, t2, t3, t_pushed, t4), stats, bool(kv), tokens),
    }


def _step_times(
    t: tuple[float, float, float, float, float, float, float], stats: SyncStats, kv: bool, tokens: float
) -> dict[str, float]:
    """The step's phase times and throughputs from its stamps: start, generated, scored, old logprobs, trained,
    pushed, synced (the push and, with an FP8 KV cache, the recalibration)."""
    t0, t1, t_scored, t2, t3, t_pushed, t4 = t
    return {
        "time/generate_s": t1 - t0,
        "time/score_s": t_scored - t1,
        "time/logprob_s": t2 - t_scored,
        "time/train_s": t3 - t2,
        "time/sync_s": t4 - t3,  # the push and, with an FP8 KV cache, the recalibration (its part below)
        # parts of the push as its transport times them: requantize (+ pack), then transfer + load (+ verify);
        # the Ray object-store path times only the whole (load = all of it, requantize 0)
        "time/sync_requantize_s": stats.requantize_seconds,
        "time/sync_load_s": stats.load_seconds,
        **({"time/kv_calibrate_s": t4 - t_pushed} if kv else {}),
        "time/step_s": t4 - t0,
        "throughput/rollout_tokens_per_s": tokens / max(t1 - t0, 1e-9),
        "throughput/train_tokens_per_s": tokens / max(t3 - t_scored, 1e-9),
    }


def _policy_update(
    cfg: RunConfig, trainer: Any, batch: SequenceBatch, adv: torch.Tensor, rollout: Any, t_scored: float
) -> tuple[dict[str, float], dict[str, float], dict[str, float], float]:
    """The policy update: its train, mismatch and correction metrics, and when the logprob phase ended
    (``t_scored`` when the old logprobs are the train forward's)."""
    mask, temperature = rollout.response_mask, cfg.sampling.temperature
    if cfg.grpo.old_logprobs == "recompute":
        old_lp = trainer.compute_logprobs(batch, temperature)
        t2 = time.perf_counter()
        mm = mismatch_metrics(rollout.logprobs, old_lp, mask)
        weights, loss_mask, corr = mismatch_correction(old_lp, rollout.logprobs, mask, cfg.recipe.correction)
        old: RecomputedOld | TrainForwardOld = RecomputedOld(old_lp, weights, loss_mask)
        train_m = trainer.policy_step(PolicyStep(batch, adv, old, cfg.grpo, temperature))
    else:  # the old logprobs are the train forward's: no logprob phase (fp8rl.train.old_logprobs)
        t2 = t_scored
        old = TrainForwardOld(rollout.logprobs, mask, cfg.recipe.correction)
        train_m = trainer.policy_step(PolicyStep(batch, adv, old, cfg.grpo, temperature))
        ess = ess_metric(train_m)  # from the batch's weight moments, which it takes out of train_m
        mm, corr = _taken(train_m, MISMATCH), {**_taken(train_m, CORRECTION), **_taken(ess, CORRECTION)}
    computed, valid = train_m.pop("tokens_computed", 0.0), train_m.pop("tokens_valid", 0.0)
    train_m["padding_waste"] = 1.0 - valid / computed if computed else 0.0  # of the tokens the forwards ran
    return train_m, mm, corr, t2


def _taken(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """The metrics under ``prefix``, removed from ``metrics``, with the prefix dropped."""
    keys = [k for k in metrics if k.startswith(prefix)]
    return {k.removeprefix(prefix): metrics.pop(k) for k in keys}


# prompts the FP8 KV-cache scales are first calibrated on, before any rollout exists
KV_CALIBRATION_PROMPTS = 64


def prompt_batch(cfg: RunConfig, parts: Parts, examples: list[Example]) -> SequenceBatch:
    """The examples' prompts alone as a trainer batch (no response tokens)."""
    prompts = prompt_format(cfg).encode_all(parts.tok, examples)
    empty = torch.zeros((len(prompts), 0), dtype=torch.long)
    return build_batch(prompts, empty, empty.float(), parts.engine.pad_token_id)


def evaluate_policy(
    cfg: RunConfig, engine: RolloutGenerator, tok: PreTrainedTokenizerBase, heldout: list[Example]
) -> dict[str, float]:
    """Greedy ``accuracy``, ``response_tokens`` and ``truncated`` of the policy ``engine`` serves on ``heldout``,
    and ``sampled_accuracy`` (avg@``cfg.eval_samples`` at the rollout temperature, fixed seed) unless
    ``cfg.eval_samples`` is 0."""
    max_tokens = cfg.sampling.max_tokens
    fmt, reward = prompt_format(cfg), reward_for(cfg)
    out = evaluate(engine, tok, heldout, max_tokens, prompt_format=fmt, reward=reward)
    if cfg.eval_samples:
        sampled = evaluate(
            engine, tok, heldout, max_tokens, temperature=cfg.sampling.temperature, samples=cfg.eval_samples,
            seed=cfg.seed, prompt_format=fmt, reward=reward,
        )  # fmt: skip
        out["sampled_accuracy"] = sampled["accuracy"]
    return out


def evaluate_heldout(cfg: RunConfig, parts: Parts, heldout: list[Example]) -> dict[str, float]:
    """``eval/accuracy`` (greedy), ``eval/response_tokens`` and ``eval/sampled_accuracy`` (``evaluate_policy``)
    of the policy the engine now serves, on the held-out examples."""
    m = evaluate_policy(cfg, parts.engine, parts.tok, heldout)
    return {f"eval/{k}": v for k, v in m.items() if k != "truncated"}


def _eval_line(m: dict[str, float]) -> str:
    sampled = f" (sampled {m['eval/sampled_accuracy']:.3f})" if "eval/sampled_accuracy" in m else ""
    return f"{m['eval/accuracy']:.3f}{sampled}"


def run_rl(
    cfg: RunConfig,
    model_dir: str | Path,
    sink: MetricsSink,
    log: Callable[[str], None] = print,
    device: str = "cpu",
    output_dir: str | Path | None = None,
    parts: Parts | None = None,
    checkpoint_dir: str | Path | None = None,
) -> RLResult:
    """Run ``cfg.steps`` RL steps from the checkpoint at ``model_dir``; metrics go to ``sink``.

    ``parts`` defaults to engine + trainer in this process (``build_parts``).  With
    ``checkpoint_dir`` and ``cfg.checkpoint_every > 0``, the loop state is saved every that
    many steps and at the end, metrics reach ``sink`` only once their step is checkpointed,
    and a run that finds a checkpoint there resumes after its step (``fp8rl.run_state``).
    With ``output_dir``, the trained policy is saved there at the end as an HF checkpoint
    (bf16, the trainer's weights; atomically, replacing what was there).  ``train/nonfinite_steps`` counts the
    steps whose gradient norm was not finite (no update); ``optim.max_nonfinite_steps`` in a row raise.
    """
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    name = cfg.recipe.name
    parts = parts or build_parts(cfg, model_dir, device)
    _log_fp8_linears(parts, sink, name, log)
    train_pool, heldout = task_examples(cfg)
    ckpt = Path(checkpoint_dir) if checkpoint_dir is not None and cfg.checkpoint_every else None
    out = MetricsBuffer(sink, buffered=ckpt is not None)
    kv_batch = prompt_batch(cfg, parts, train_pool[:KV_CALIBRATION_PROMPTS])
    parts.calibrate_kv(kv_batch)  # FP8 KV cache: scales before the step-0 evaluation
    result, first = _start_or_resume(cfg, parts, heldout, rng, out, ckpt, log)
    if first > 1:
        parts.calibrate_kv(kv_batch)  # resumed: scales of the restored policy, not of the initial checkpoint
    for step in range(first, cfg.steps + 1):
        metrics = rl_step(cfg, parts, rng.sample(train_pool, cfg.grpo.prompts_per_step), step)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            result.final = evaluate_heldout(cfg, parts, heldout)
            metrics.update(result.final)
        metrics["train/nonfinite_steps"] = float(_nonfinite_steps(result.history, metrics))
        out.log(metrics, step=step)
        result.history.append(metrics)
        log(_step_line(name, step, cfg.steps, metrics))
        _stop_after_nonfinite_steps(result.history, step, cfg.optim.max_nonfinite_steps)
        if ckpt is not None and (step % cfg.checkpoint_every == 0 or step == cfg.steps):
            _checkpoint(cfg, parts, ckpt, step, rng, result, out)
    out.flush()
    if output_dir is not None:
        parts.save_policy(output_dir)
        log(f"[{name}] trained policy saved to {output_dir}")
    return result


def _checkpoint(
    cfg: RunConfig, parts: Parts, ckpt: Path, step: int, rng: random.Random, result: RLResult, out: MetricsBuffer
) -> None:
    """Save the loop's state after ``step`` in ``ckpt``, then log the metrics it covers."""
    state = LoopState(step, parts.trainer.state_dict(), rng.getstate(), torch.get_rng_state(), result.initial, result.final, result.history)  # fmt: skip
    save_loop_state(ckpt, state, cfg.checkpoint_keep)
    out.flush()


class NonFiniteGradientError(UserError):
    """The gradient norm was NaN or infinite for ``optim.max_nonfinite_steps`` steps in a row."""


def _nonfinite(metrics: dict[str, float]) -> bool:
    return not math.isfinite(metrics.get("train/grad_norm", 0.0))


def _nonfinite_steps(history: list[dict[str, float]], metrics: dict[str, float]) -> int:
    """How many steps so far, this one included, had a non-finite gradient norm (their updates were skipped)."""
    return sum(map(_nonfinite, history)) + _nonfinite(metrics)


def _stop_after_nonfinite_steps(history: list[dict[str, float]], step: int, limit: int) -> None:
    """Raise once the last ``limit`` steps all had a non-finite gradient norm: the policy no longer learns."""
    tail = history[-limit:]
    if len(tail) == limit and all(map(_nonfinite, tail)):
        raise NonFiniteGradientError(
            f"step {step}: the gradient norm was non-finite ({tail[-1]['train/grad_norm']}) in {limit} consecutive "
            f"steps (optim.max_nonfinite_steps: {limit}), each skipping its update; the run stops. Lower optim.lr, "
            "or try a recipe with finer FP8 scaling; raise optim.max_nonfinite_steps to tolerate longer runs of them"
        )


def _log_fp8_linears(parts: Parts, sink: MetricsSink, name: str, log: Callable[[str], None]) -> None:
    """How many linears the engine and the trainer run in FP8: a run parameter, and a line of the log."""
    sink.log_params(parts.fp8_linears)
    log(f"[{name}] FP8 linears: {parts.fp8_linears.get('fp8_linears_engine', 0)} in the rollout engine, "
        f"{parts.fp8_linears.get('fp8_linears_trainer', 0)} in the trainer")  # fmt: skip


def _start_or_resume(
    cfg: RunConfig,
    parts: Parts,
    heldout: list[Example],
    rng: random.Random,
    out: MetricsBuffer,
    ckpt: Path | None,
    log: Callable[[str], None],
) -> tuple[RLResult, int]:
    """The result so far and the first step to run: a fresh start (held-out evaluation at step 0), or
    the newest checkpoint in ``ckpt`` restored into the trainer, the RNGs and the engine."""
    name = cfg.recipe.name
    state = load_latest(ckpt) if ckpt is not None else None
    if state is None:  # a run an earlier attempt logged into without a checkpoint: its steps are not logged twice
        out.held = {step for step, _ in out.sink.history("time/step_s")} | _logged_step_zero(out.sink)
        initial = evaluate_heldout(cfg, parts, heldout)
        out.log(initial, step=0)
        log(f"[{name}] step 0 held-out accuracy {_eval_line(initial)}")
        return RLResult(name, initial, initial), 1
    parts.trainer.load_state_dict(state.trainer)
    restore_python_rng(rng, state.python_rng)
    torch.set_rng_state(state.torch_rng)
    parts.push_weights(state.step)
    _relog_unflushed(out, state.initial, state.history)
    log(f"[{name}] resumed from the checkpoint of step {state.step} in {ckpt}")
    return RLResult(name, state.initial, state.final, state.history), state.step + 1


def _relog_unflushed(out: MetricsBuffer, initial: dict[str, float], history: list[dict[str, float]]) -> None:
    """Log the checkpointed steps the sink does not hold (a kill between checkpoint and flush), and mark the later
    steps it holds (an unreadable newest checkpoint, so an older one was loaded) as not to be logged again.

    Each step's metrics go to the sink in one call (one MLflow batch), so a step is there
    whole or not at all; its ``time/step_s`` says which.
    """
    sink = out.sink
    if not _logged_step_zero(sink):
        sink.log_metrics(initial, step=0)
    held = {step for step, _ in sink.history("time/step_s")}
    for step, metrics in enumerate(history, start=1):
        if step not in held:
            sink.log_metrics(metrics, step=step)
    out.held = {step for step in held if step > len(history)}


def _logged_step_zero(sink: MetricsSink) -> set[int]:
    return {0} if any(step == 0 for step, _ in sink.history("eval/accuracy")) else set()


def _step_line(name: str, step: int, steps: int, m: dict[str, float]) -> str:
    return (
        f"[{name}] step {step}/{steps} reward {m['reward']:.3f} "
        f"loss {m['train/loss']:+.4f} tmpe {m['mismatch/token_mult_prob_error']:.5f} "
        + (f"eval {_eval_line(m)} " if "eval/accuracy" in m else "")
        + f"({m['time/step_s']:.1f}s)"
    )
