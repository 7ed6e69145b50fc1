"""One metric vocabulary for the runs of a comparison, so MLflow's "compare runs" view and its charts put the
recipes side by side without reading code.

MLflow's compare view (and the runs table's columns and charts) shows each run's *latest* value of a metric key, and
lines runs up by key: a quantity logged under two names in two runs shows as two half-empty columns. Every recipe
run of a comparison therefore carries these ``summary/*`` keys, whichever step measured them:

| quantity | key | an RL run (``fp8rl.experiment``) | a benchmark-only run (``components.benchmark``) |
|---|---|---|---|
| step time, s | ``summary/step_s`` | median over its steps of ``time/step_s`` | median of the timed steps (``bench/step_s``) |
| rollout tokens/s | ``summary/rollout_tokens_per_s`` | median of ``throughput/rollout_tokens_per_s`` | ``bench/rollout_tokens_per_s`` |
| train tokens/s | ``summary/train_tokens_per_s`` | median of ``throughput/train_tokens_per_s`` | ``bench/train_tokens_per_s`` |
| held-out accuracy | ``summary/final_accuracy`` | greedy held-out accuracy after the last step | (not measured) |
| token_mult_prob_error | ``summary/mean_token_mult_prob_error`` | run mean of the per-step value | (not measured) |

The per-step keys (``time/step_s``, ``eval/accuracy``, ``mismatch/token_mult_prob_error``, ...) are the same in
every RL run, so MLflow's charts overlay them by step; ``evaluate/*`` (the evaluation step) and ``bench/*`` (the
benchmark step) are logged into the same recipe run in the recipe-comparison pipeline.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

STEP_S = "summary/step_s"
ROLLOUT_TOKENS_PER_S = "summary/rollout_tokens_per_s"
TRAIN_TOKENS_PER_S = "summary/train_tokens_per_s"
FINAL_ACCURACY = "summary/final_accuracy"
MEAN_TOKEN_MULT_PROB_ERROR = "summary/mean_token_mult_prob_error"
# quantity -> key: what the compare view of a recipe comparison lines up
COMPARE_KEYS: dict[str, str] = {
    "step time (s)": STEP_S,
    "rollout tokens/s": ROLLOUT_TOKENS_PER_S,
    "train tokens/s": TRAIN_TOKENS_PER_S,
    "held-out accuracy": FINAL_ACCURACY,
    "token_mult_prob_error": MEAN_TOKEN_MULT_PROB_ERROR,
}
# the throughput keys and the per-step (RL) and benchmark keys they summarise
_THROUGHPUT = {
    STEP_S: ("time/step_s", "bench/step_s"),
    ROLLOUT_TOKENS_PER_S: ("throughput/rollout_tokens_per_s", "bench/rollout_tokens_per_s"),
    TRAIN_TOKENS_PER_S: ("throughput/train_tokens_per_s", "bench/train_tokens_per_s"),
}


def step_throughput(history: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The throughput summary of an RL run: the median over its steps of each per-step key (robust to the first
    step's warm-up); keys no step logged are left out."""
    out = {}
    for key, (per_step, _) in _THROUGHPUT.items():
        values = [h[per_step] for h in history if per_step in h]
        if values:
            out[key] = float(statistics.median(values))
    return out


def bench_throughput(bench: Mapping[str, float]) -> dict[str, float]:
    """The throughput summary of a benchmark (``bench/*`` metrics, already medians of the timed steps)."""
    return {key: float(bench[b]) for key, (_, b) in _THROUGHPUT.items() if b in bench}
