"""Rollout engines: the ``RolloutEngine`` interface and the built-in torch engine (vLLM: issue 7)."""

from fp8rl.rollout.base import Rollout, RolloutEngine, RolloutGenerator, SamplingParams
from fp8rl.rollout.fp8_linear import FP8InferenceLinear
from fp8rl.rollout.torch_engine import TorchRolloutEngine, filter_logits

__all__ = [
    "FP8InferenceLinear",
    "Rollout",
    "RolloutEngine",
    "RolloutGenerator",
    "SamplingParams",
    "TorchRolloutEngine",
    "filter_logits",
]
