"""Held-out evaluation of a checkpoint as a recipe's rollout engine serves it (the pipeline's evaluation stage).

The checkpoint is loaded into the built-in rollout engine with the recipe's rollout precision
and scaling (FP8 weights and activations for the FP8 recipes), and evaluated on the held-out
examples of the run config's task (``fp8rl.loop.task_examples``, the same problems for every
recipe and seed):

- ``evaluate/accuracy``: greedy exact-match accuracy;
- ``evaluate/sampled_accuracy``: avg@``cfg.eval_samples`` at the rollout temperature (seeded);
  left out when ``cfg.eval_samples`` is 0;
- ``evaluate/response_tokens``: mean response length (tokens) of the greedy responses;
- ``evaluate/truncated``: fraction of greedy responses cut at ``cfg.sampling.max_tokens``.
"""

from __future__ import annotations

from pathlib import Path

from fp8rl.bench.throughput import resolve_device
from fp8rl.config import RunConfig
from fp8rl.evaluation import evaluate
from fp8rl.loop import quant_spec, task_examples
from fp8rl.models.loading import load_tokenizer
from fp8rl.rollout.torch_engine import TorchRolloutEngine


def evaluate_checkpoint(cfg: RunConfig, model_dir: str | Path, device: str = "auto") -> dict[str, float]:
    """Evaluate ``model_dir`` under ``cfg.recipe``'s rollout numerics; returns the ``evaluate/*`` metrics."""
    q = cfg.recipe.quant
    engine = TorchRolloutEngine(
        model_dir, cfg.recipe.rollout_precision, quant_spec(cfg), q.bf16_first_layers, q.bf16_last_layers,
        resolve_device(device),
    )  # fmt: skip
    tok = load_tokenizer(model_dir)
    _, heldout = task_examples(cfg)
    max_tokens = cfg.sampling.max_tokens
    greedy = evaluate(engine, tok, heldout, max_tokens)
    out = {
        "evaluate/accuracy": greedy["accuracy"],
        "evaluate/response_tokens": greedy["response_tokens"],
        "evaluate/truncated": greedy["truncated"],
    }
    if cfg.eval_samples:
        sampled = evaluate(
            engine, tok, heldout, max_tokens, temperature=cfg.sampling.temperature, samples=cfg.eval_samples,
            seed=cfg.seed,
        )  # fmt: skip
        out["evaluate/sampled_accuracy"] = sampled["accuracy"]
    return out
