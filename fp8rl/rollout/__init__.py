"""Rollout engines: the ``RolloutEngine`` interface, the built-in torch engine and the vLLM engine.

Everything here imports without vLLM; ``VLLMRolloutEngine`` imports it when an engine starts.
"""

from fp8rl.rollout.base import Rollout, RolloutEngine, RolloutGenerator, SamplingParams
from fp8rl.rollout.fp8_linear import FP8InferenceLinear
from fp8rl.rollout.kv_calibration import KVScales, calibrate_kv_scales, kv_scale_metrics
from fp8rl.rollout.torch_engine import TorchRolloutEngine, filter_logits
from fp8rl.rollout.vllm_engine import VLLMRolloutEngine

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
