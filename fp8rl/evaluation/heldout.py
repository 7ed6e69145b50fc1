"""Held-out evaluation with a rollout engine: greedy accuracy and response statistics."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from fp8rl.rollout.base import Rollout, RolloutGenerator, SamplingParams
from fp8rl.tasks import Example
from fp8rl.tasks.prompts import PromptFormat
from fp8rl.tasks.rewards import ExactMatch, Reward


def decode_responses(tokenizer: PreTrainedTokenizerBase, rollout: Rollout) -> list[str]:
    out = []
    for ids, mask in zip(rollout.response_ids.tolist(), rollout.response_mask.tolist(), strict=True):
        kept = [t for t, m in zip(ids, mask, strict=True) if m > 0]
        out.append(str(tokenizer.decode(kept, skip_special_tokens=True)))
    return out


def evaluate(
    engine: RolloutGenerator,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    max_tokens: int = 8,
    batch_size: int = 256,
    temperature: float = 0.0,
    samples: int = 1,
    seed: int = 0,
    prompt_format: PromptFormat | None = None,
    reward: Reward | None = None,
) -> dict[str, float]:
    """Accuracy (mean ``reward``, exact match by default) on ``examples``: greedy by default, or the mean over ``samples`` sampled
    responses per example at ``temperature`` (avg@k, as DAPO reports AIME), seeded.

    Returns ``accuracy``, ``response_tokens`` (mean per response) and ``truncated`` (fraction).
    """
    if samples < 1 or (temperature == 0.0 and samples != 1):
        raise ValueError(f"samples must be >= 1, and 1 for greedy decoding; got {samples} at T={temperature}")
    fmt, scorer = prompt_format or PromptFormat(), reward or ExactMatch()
    items = [e for e in examples for _ in range(samples)]
    correct, tokens, truncated = 0.0, 0.0, 0.0
    for s in range(0, len(items), batch_size):
        chunk = items[s : s + batch_size]
        prompts = fmt.encode_all(tokenizer, chunk)
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + s)
        rollout = engine.generate(prompts, params)
        correct += sum(scorer.score(decode_responses(tokenizer, rollout), chunk).rewards)
        tokens += float(rollout.response_mask.sum())
        truncated += float((~rollout.finished).sum())
    n = max(len(items), 1)
    return {"accuracy": correct / n, "response_tokens": tokens / n, "truncated": truncated / n}
