"""Rollout engines: the ``RolloutEngine`` interface, the built-in torch engine and the vLLM engine.

Everything here imports without vLLM; ``VLLMRolloutEngine`` imports it when an engine starts.  The vLLM
engine's module (which reads recipes, hence pydantic) loads on first use of the name, so the weight-sync
transport, which imports this package, stays free of pydantic on machines with torch alone.
"""

from typing import Any

from fp8rl.rollout.base import Rollout, RolloutEngine, RolloutGenerator, SamplingParams
from fp8rl.rollout.fp8_linear import FP8InferenceLinear
from fp8rl.rollout.kv_calibration import KVScales, calibrate_kv_scales, kv_scale_metrics
from fp8rl.rollout.torch_engine import TorchRolloutEngine, filter_logits

__all__ = [
    "FP8InferenceLinear",
    "KVScales",
    "Rollout",
    "RolloutEngine",
    "RolloutGenerator",
    "SamplingParams",
    "TorchRolloutEngine",
    "VLLMRolloutEngine",
    "calibrate_kv_scales",
    "filter_logits",
    "kv_scale_metrics",
]


def __getattr__(name: str) -> Any:
    if name == "VLLMRolloutEngine":
        from fp8rl.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
