"""Typed configuration: precision recipes and the RL run.  Imports no torch, so tooling can load it cheaply.

A recipe is the axis every comparison is made along:

| recipe        | rollout | training |
|---------------|---------|----------|
| `bf16`        | BF16    | BF16     |
| `fp8-rollout` | FP8     | BF16     |
| `fp8-e2e`     | FP8     | FP8 (the same scaling as rollout) |

Recipes are YAML files validated by these models; an invalid value is a
``ConfigError`` naming the field and the allowed values before anything runs.

By responsibility: ``recipe`` (the recipes), ``training`` (GRPO, sampling, the optimizer), ``task`` (task and
reward), ``rollout`` (the rollout engine), ``run`` (the run and its Ray section), ``base`` (what they share).
"""

from fp8rl.config.base import ConfigError, format_validation_errors, read_yaml
from fp8rl.config.recipe import (
    BUILTIN_RECIPES,
    CORE_RECIPES,
    RECIPE_DIR,
    Correction,
    MISCorrection,
    NoCorrection,
    QuantConfig,
    Recipe,
    TISCorrection,
    load_recipe,
    parse_recipe,
    vllm_recipe_problem,
)
from fp8rl.config.rollout import (
    ENGINE_KWARGS_SET_BY_FP8RL,
    TOKEN_HEAD_ATTENTION,
    RolloutConfig,
    kv_scales_calibrated,
    rollout_recipe,
)
from fp8rl.config.run import RayConfig, RunConfig, TrackingConfig, load_run_config_data, parse_run_config
from fp8rl.config.task import (
    ArithmeticTaskConfig,
    ExactMatchRewardConfig,
    JsonlTaskConfig,
    PythonRewardConfig,
    RewardConfig,
    TaskConfig,
    TaskFields,
    WordProblemsTaskConfig,
)
from fp8rl.config.training import GRPOConfig, LossAgg, OptimConfig, SamplingConfig

__all__ = [
    "BUILTIN_RECIPES",
    "CORE_RECIPES",
    "ENGINE_KWARGS_SET_BY_FP8RL",
    "RECIPE_DIR",
    "TOKEN_HEAD_ATTENTION",
    "ArithmeticTaskConfig",
    "ConfigError",
    "Correction",
    "ExactMatchRewardConfig",
    "GRPOConfig",
    "JsonlTaskConfig",
    "LossAgg",
    "MISCorrection",
    "NoCorrection",
    "OptimConfig",
    "PythonRewardConfig",
    "QuantConfig",
    "RayConfig",
    "Recipe",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "TISCorrection",
    "TaskConfig",
    "TaskFields",
    "TrackingConfig",
    "WordProblemsTaskConfig",
    "format_validation_errors",
    "kv_scales_calibrated",
    "load_recipe",
    "load_run_config_data",
    "parse_recipe",
    "parse_run_config",
    "read_yaml",
    "rollout_recipe",
    "vllm_recipe_problem",
]
