"""Held-out evaluation with a rollout engine: greedy accuracy and response statistics."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from fp8rl.rollout.base import Rollout, RolloutEngine, SamplingParams
from fp8rl.tasks import Example, exact_match_reward


def decode_responses(tokenizer: PreTrainedTokenizerBase, rollout: Rollout) -> list[str]:
    out = []
    for ids, mask in zip(rollout.response_ids.tolist(), rollout.response_mask.tolist(), strict=True):
        kept = [t for t, m in zip(ids, mask, strict=True) if m > 0]
        out.append(str(tokenizer.decode(kept, skip_special_tokens=True)))
    return out


def evaluate(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    max_tokens: int = 8,
    batch_size: int = 256,
) -> dict[str, float]:
    """Greedy decoding on ``examples``: ``accuracy`` (exact match), ``response_tokens`` (mean), ``truncated``."""
    correct, tokens, truncated = 0.0, 0.0, 0.0
    for s in range(0, len(examples), batch_size):
        chunk = examples[s : s + batch_size]
        prompts = [tokenizer(e.prompt).input_ids for e in chunk]
        rollout = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        for text, ex in zip(decode_responses(tokenizer, rollout), chunk, strict=True):
            correct += exact_match_reward(text, ex.answer)
        tokens += float(rollout.response_mask.sum())
        truncated += float((~rollout.finished).sum())
    n = max(len(examples), 1)
    return {"accuracy": correct / n, "response_tokens": tokens / n, "truncated": truncated / n}
