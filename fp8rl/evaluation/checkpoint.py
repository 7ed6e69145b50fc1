"""Held-out evaluation of a checkpoint as a recipe's rollout engine serves it (the pipeline's evaluation stage).

The checkpoint is loaded into the built-in rollout engine with the recipe's rollout precision
and scaling (FP8 weights and activations for the FP8 recipes), and evaluated on the held-out
examples of the run config's task (``fp8rl.build.task_examples``, the same problems for every
recipe and seed):

- ``evaluate/accuracy``: greedy exact-match accuracy;
- ``evaluate/sampled_accuracy``: avg@``cfg.eval_samples`` at the rollout temperature (seeded);
  left out when ``cfg.eval_samples`` is 0;
- ``evaluate/response_tokens``: mean response length (tokens) of the greedy responses;
- ``evaluate/truncated``: fraction of greedy responses cut at ``cfg.sampling.max_tokens``.
"""

from __future__ import annotations

from pathlib import Path

from fp8rl.build import build_torch_engine, task_examples
from fp8rl.config import RunConfig
from fp8rl.devices import resolve_device
from fp8rl.loop import evaluate_policy
from fp8rl.models.loading import load_tokenizer


def evaluate_checkpoint(cfg: RunConfig, model_dir: str | Path, device: str = "auto") -> dict[str, float]:
    """Evaluate ``model_dir`` under ``cfg.recipe``'s rollout numerics; returns the ``evaluate/*`` metrics."""
    engine = build_torch_engine(cfg, model_dir, resolve_device(device))
    _, heldout = task_examples(cfg)
    metrics = evaluate_policy(cfg, engine, load_tokenizer(model_dir), heldout)
    return {f"evaluate/{k}": v for k, v in metrics.items()}
