"""The rollout engine's settings (vLLM's above all) and the recipe as the engine serves it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from fp8rl.config.base import Strict
from fp8rl.config.recipe import Recipe

# the vLLM attention backend that reads a per-token-head scaled FP8 KV cache (rollout.kv_scaling token_head)
TOKEN_HEAD_ATTENTION = "TRITON_ATTN"

# vllm.LLM arguments fp8rl sets itself, and what sets them: rollout.engine_kwargs may not name them
ENGINE_KWARGS_SET_BY_FP8RL = {
    "model": "the checkpoint it serves (model, converted for the recipe)",
    "tokenizer": "its token-id prompts (no tokenizer in the engine)",
    "skip_tokenizer_init": "its token-id prompts (no tokenizer in the engine)",
    "dtype": "the recipe (BF16 activations)",
    "quantization": "recipe.rollout_precision, recipe.quant and rollout.fp8_scaling",
    "seed": "seed",
    "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "enforce_eager": "rollout.enforce_eager",
    "logprobs_mode": "its logprob contract (the temperature-scaled distribution's)",
    "kv_cache_dtype": "recipe.kv_cache and rollout.kv_scaling",
    "calculate_kv_scales": "recipe.kv_cache and rollout.kv_scaling (fp8rl recalibrates the scales)",
    "enable_sleep_mode": "ray.layout (colocated engines sleep)",
    "enable_prefix_caching": "rollout.prefix_caching",
    "attention_backend": "rollout.attention_backend",
    "max_model_len": "rollout.max_model_len",
    "tensor_parallel_size": "rollout.tensor_parallel_size",
    "distributed_executor_backend": "rollout.tensor_parallel_size (each rank a Ray actor of fp8rl's)",
    "disable_custom_all_reduce": "rollout.tensor_parallel_size",
    "pipeline_parallel_size": "nothing: fp8rl's weight sync splits the model by tensor parallelism only",
    "data_parallel_size": "ray.rollout_workers (one engine per worker or tensor-parallel group)",
}


class RolloutConfig(Strict):
    """Which rollout engine serves generation, and the vLLM engine's settings."""

    # torch: the built-in engine (embedded default, CPU); vllm: vLLM on a GPU (fp8rl.rollout.vllm_engine)
    engine: Literal["torch", "vllm"] = "torch"
    # vllm: the share of GPU memory the engine takes (weights + KV cache); the trainer needs the rest
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    # vllm: False captures CUDA graphs (slower start, faster decode)
    enforce_eager: bool = False
    # vllm: None takes the model's max_position_embeddings
    max_model_len: int | None = Field(None, ge=1)
    # vllm + kv_cache fp8: calibrated scale = amax * margin / 448, the amax a high quantile of |k|, |v|
    kv_scale_margin: float = Field(1.1, ge=1.0)
    kv_scale_quantile: float = Field(0.999, gt=0.0, le=1.0)
    # vllm + kv_cache fp8: calibrate on evenly spaced rows of the step's batch holding about this many tokens
    # (the recalibration is a forward of the policy, so its time grows with the batch); None: the whole batch
    kv_calibration_tokens: int | None = Field(None, ge=1)
    # FP8 rollouts: how the served weights are scaled. recipe: as recipe.quant says (the trainer's scaling);
    # channel: one scale per output channel, activations scaled per token on the fly (vLLM's W8A8 CUTLASS GEMM,
    # its compile passes fold that quantization into the norms and the SiLU gate; at Llama-3.1-8B shape on an
    # H200 1.11x block FP8's decode, docs/benchmarks.md). The trainer keeps recipe.quant; every sync requantizes
    # the weights for the rollout anyway (rollout_recipe). BF16 rollouts ignore it, so one config serves a
    # comparison of bf16 and FP8 recipes
    fp8_scaling: Literal["recipe", "channel"] = "recipe"
    # vllm on Ray: one engine split over this many rollout workers (tensor parallelism, one GPU each, vLLM's
    # external_launcher: every worker of a group runs the same requests and holds 1/size of each weight matrix and of
    # the KV heads; for a model one GPU cannot hold with its KV cache). ray.rollout_workers must be a multiple of it
    # (rollout_workers / size engines share the prompts); a group's workers should sit on one node
    tensor_parallel_size: int = Field(1, ge=1)
    # vllm + kv_cache fp8: how the cache is scaled. tensor: one scale for K and one for V a layer, which fp8rl
    # recalibrates from the trainer's policy after every weight update (a forward over kv_calibration_tokens of
    # the batch; vLLM's FlashAttention 3 reads the cache). token_head: vLLM computes a scale per token and KV head as
    # it writes the cache (its fp8_per_token_head cache, 4 bytes a token and head more; read by vLLM's Triton
    # attention): nothing to calibrate, and no scale is stale after an update
    kv_scaling: Literal["tensor", "token_head"] = "tensor"
    # vllm: the attention backend, by vLLM's name (FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, ...); None: vLLM
    # chooses (FlashAttention 3 on Hopper; TRITON_ATTN for kv_scaling token_head, the one that reads that cache)
    attention_backend: str | None = Field(None, pattern=r"^[A-Z][A-Z0-9_]*$")
    # vllm: reuse the KV blocks of prompt prefixes already computed (vLLM's automatic prefix caching: the samples of
    # one prompt prefill it once; fp8rl drops the cache after every weight update). It hashes every full block of
    # every request as the responses grow, host work in each decode step: off when prompts are short and the
    # decode is host-bound (the 8B benchmarks, docs/benchmarks.md)
    prefix_caching: bool = True
    # vllm: further arguments of vllm.LLM (vLLM's engine arguments: block_size, max_num_seqs,
    # max_num_batched_tokens, compilation_config, ...) on top of the ones fp8rl sets, which it refuses here
    # (ENGINE_KWARGS_SET_BY_FP8RL); names vLLM does not know are refused when the engine starts
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _engine_kwargs_not_set_by_fp8rl(self) -> RolloutConfig:
        for key in self.engine_kwargs:
            if key in ENGINE_KWARGS_SET_BY_FP8RL:
                raise ValueError(
                    f"rollout.engine_kwargs.{key}: fp8rl sets it from {ENGINE_KWARGS_SET_BY_FP8RL[key]}; "
                    "leave it out of engine_kwargs"
                )
        return self

    @model_validator(mode="after")
    def _kv_scaling_backend(self) -> RolloutConfig:
        if self.kv_scaling == "token_head" and self.attention_backend not in (None, TOKEN_HEAD_ATTENTION):
            raise ValueError(
                f"rollout.kv_scaling 'token_head' is read by vLLM's {TOKEN_HEAD_ATTENTION} attention only, not "
                f"rollout.attention_backend {self.attention_backend!r} (leave it unset)"
            )
        return self

    def vllm_attention_backend(self, fp8_cache: bool) -> str | None:
        """The backend vLLM is asked for: the configured one, or the one a per-token-head FP8 cache needs
        (``kv_scaling`` means nothing for a BF16 cache)."""
        if fp8_cache and self.kv_scaling == "token_head":
            return TOKEN_HEAD_ATTENTION
        return self.attention_backend


def kv_scales_calibrated(recipe: Recipe, rollout: RolloutConfig) -> bool:
    """Whether the rollout's FP8 KV cache has per-tensor scales that fp8rl recalibrates after every update."""
    return recipe.kv_cache == "fp8" and rollout.kv_scaling == "tensor"


def rollout_recipe(recipe: Recipe, rollout: RolloutConfig) -> Recipe:
    """``recipe`` as the rollout engine serves it: with ``rollout.fp8_scaling: channel`` its quant granularity is
    ``row`` (per output channel, ``fp8rl.quant``'s name), whatever the trainer's; otherwise ``recipe`` itself.
    The engine's checkpoint, its FP8 modules and every sync's requantization follow this recipe."""
    if rollout.fp8_scaling == "channel" and recipe.rollout_precision == "fp8":
        return recipe.model_copy(update={"quant": recipe.quant.model_copy(update={"granularity": "row"})})
    return recipe
