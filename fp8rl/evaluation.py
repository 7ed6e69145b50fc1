"""Held-out evaluation with a rollout engine: greedy accuracy and response statistics."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from fp8rl.rollout.base import Rollout, RolloutGenerator, SamplingParams
from fp8rl.tasks import Example, exact_match_reward


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
) -> dict[str, float]:
    """Exact-match accuracy on ``examples``: greedy by default, or the mean over ``samples`` sampled
    responses per example at ``temperature`` (avg@k, as DAPO reports AIME), seeded.

    Returns ``accuracy``, ``response_tokens`` (mean per response) and ``truncated`` (fraction).
    """
    if samples < 1 or (temperature == 0.0 and samples != 1):
        raise ValueError(f"samples must be >= 1, and 1 for greedy decoding; got {samples} at T={temperature}")
    items = [e for e in examples for _ in range(samples)]
    correct, tokens, truncated = 0.0, 0.0, 0.0
    for s in range(0, len(items), batch_size):
        chunk = items[s : s + batch_size]
        prompts = [tokenizer(e.prompt).input_ids for e in chunk]
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + s)
        rollout = engine.generate(prompts, params)
        for text, ex in zip(decode_responses(tokenizer, rollout), chunk, strict=True):
            correct += exact_match_reward(text, ex.answer)
        tokens += float(rollout.response_mask.sum())
        truncated += float((~rollout.finished).sum())
    n = max(len(items), 1)
    return {"accuracy": correct / n, "response_tokens": tokens / n, "truncated": truncated / n}
