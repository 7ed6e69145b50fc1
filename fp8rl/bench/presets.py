"""Named layouts of ``fp8rl bench step --preset NAME``: the model shape, recipes, batch and run-config settings of a
measured table, so that one command reproduces it.  ``--config``, the flags and ``--set`` still override any field
(preset < --config < flags < --set).  docs/benchmarks.md gives each preset's last measurement.

No YAML files: the settings are the product's, versioned with the code that they configure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fp8rl.errors import UserError

# FSDP2 over two GPUs, a vLLM worker beside each rank (colocated, asleep while the trainer runs), CUDA IPC sync,
# activations recomputed in the backward, the decoder's RMSNorms, SiLU gate and rotary embedding compiled.
_TWO_GPU_COLOCATED: dict[str, Any] = {
    "rollout": {"engine": "vllm", "gpu_memory_utilization": 0.45, "enforce_eager": False, "max_model_len": 2048},
    "optim": {"activation_checkpointing": True, "compile_elementwise": True},
    "ray": {
        "trainer_workers": 2, "rollout_workers": 2, "trainer_sharding": "fsdp", "layout": "colocated", "sync": "ipc",
        "object_store_mb": 2048, "actor_timeout_s": 1800,
    },
}  # fmt: skip


# One GPU: the trainer (FSDP2 over its one rank: the fp32 masters are the parameters and no bf16 copy of the model is
# held; each layer's bf16 weights are gathered for its forward and backward) and one vLLM engine (CUDA graphs) share
# the GPU, CUDA IPC sync. AdamW's two moments wait in host memory between steps; the engine sleeps (vLLM's level 1:
# weights to host memory, KV cache freed) while the trainer runs and stays awake from the sync to the generation;
# activations are recomputed in the backward; the decoder's RMSNorms, SiLU gate and rotary embedding are compiled.
_ONE_GPU_COLOCATED: dict[str, Any] = {
    "rollout": {"engine": "vllm", "enforce_eager": False, "max_model_len": 2048},
    # FP8 only for the linears whose GEMM pays for it (docs/benchmarks.md, "Where FP8 training pays"): at 8B the
    # K and V projections train in BF16, at 3B the attention's four
    "optim": {
        "activation_checkpointing": True, "compile_elementwise": True, "offload_optimizer_state": True,
        "fp8_min_gemm_gflop": 500.0,
    },
    "ray": {
        "trainer_workers": 1, "rollout_workers": 1, "trainer_sharding": "fsdp", "layout": "colocated", "sync": "ipc",
        "object_store_mb": 2048, "actor_timeout_s": 1800, "sleep_after_sync": False,
    },
}  # fmt: skip

# the headline recipe: block-scaled FP8 training (fp8-e2e-kv: 128x128 weights, 1x128 activations and gradients) with
# an FP8 KV cache; the rollout serves per-channel FP8 weights requantized from the trainer's at every sync (vLLM's
# W8A8 CUTLASS GEMM, 1.11x block FP8's decode at 8B), as the accuracy study ran it
HEADLINE_RECIPES = ("bf16", "fp8-e2e-kv")

# the 8B presets' rollout: per-channel FP8 weights, no prefix caching (a host-bound decode skips the per-step block
# hashing), the FP8 KV scales calibrated on 4k tokens of the step's batch
_CHANNEL_KV_ROLLOUT: dict[str, Any] = {"fp8_scaling": "channel", "prefix_caching": False, "kv_calibration_tokens": 4096}


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on ``base``, section by section (nested mappings merged, other values replaced)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@dataclass(frozen=True)
class BenchPreset:
    """One benchmark layout: what ``fp8rl bench step --preset`` runs unless a flag says otherwise."""

    description: str
    shape: str
    recipes: tuple[str, ...]
    prompts: int
    samples: int = 8
    max_tokens: int = 1024
    steps: int = 2
    warmup: int = 1
    micro_batch_tokens: int = 16384
    config: dict[str, Any] = field(default_factory=dict)  # run-config fields (RunConfig)

    def run_fields(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """The run-config fields of one recipe's benchmark under this preset: its settings and its batch (prompts
        x samples responses of ``max_tokens``, EOS ignored; the micro-batch), ``overrides`` (run-config fields) over
        them.  The ``fp8-benchmark`` pipeline's ``preset``; ``fp8rl bench step`` gets the same from ``step_config``."""
        batch = {
            "grpo": {"prompts_per_step": self.prompts, "group_size": self.samples},
            "sampling": {"max_tokens": self.max_tokens, "ignore_eos": True},
            "optim": {"micro_batch_tokens": self.micro_batch_tokens},
        }
        return _merged(_merged(self.config, batch), overrides)

    def sizes(self) -> dict[str, Any]:
        """The bench flags this preset sets (``fp8rl bench step``'s argument names)."""
        return {
            "shape": self.shape, "recipes": list(self.recipes), "prompts": self.prompts, "samples": self.samples,
            "max_tokens": self.max_tokens, "steps": self.steps, "warmup": self.warmup,
            "micro_batch_tokens": self.micro_batch_tokens,
        }  # fmt: skip


def _one_gpu(description: str, shape: str, gpu_memory_utilization: float) -> BenchPreset:
    """A one-GPU colocated preset (``_ONE_GPU_COLOCATED``) of the headline recipes at 64 prompts: the shape and the
    engine's memory share are what differ between GPUs."""
    rollout = {**_CHANNEL_KV_ROLLOUT, "gpu_memory_utilization": gpu_memory_utilization}
    return BenchPreset(
        description, shape=shape, recipes=HEADLINE_RECIPES, prompts=64,
        config=_merged(_ONE_GPU_COLOCATED, {"rollout": rollout}),
    )  # fmt: skip


PRESETS: dict[str, BenchPreset] = {
    "llama-8b-h200x2": BenchPreset(
        "Llama-3.1-8B shape on two 141 GB GPUs (H200): FSDP2 + vLLM colocated, CUDA IPC sync, AdamW state on the "
        "GPU; bf16 against fp8-e2e-row-kv (per-channel FP8 weights, per-token activations, FP8 KV cache)",
        shape="llama-8b",
        recipes=("bf16", "fp8-e2e-row-kv"),
        prompts=64,
        config=_merged(
            _TWO_GPU_COLOCATED,
            {
                "rollout": _CHANNEL_KV_ROLLOUT,
                "optim": {"offload_optimizer_state": False},
                # the engines stay awake from the sync to the generation (nothing sleeps and wakes only to be
                # overwritten)
                "ray": {"sleep_after_sync": False},
            },
        ),
    ),
    "llama-8b-h100x2": BenchPreset(
        "Llama-3.1-8B shape on two 80 GB GPUs (H100): the same layout, AdamW's moments in host memory between "
        "steps (fp32 masters, moments and gradients would not fit beside the engines)",
        shape="llama-8b",
        recipes=("bf16", "fp8-e2e-row-kv"),
        prompts=32,
        config=_merged(
            _TWO_GPU_COLOCATED,
            {
                "rollout": _CHANNEL_KV_ROLLOUT,
                "optim": {"offload_optimizer_state": True},
            },
        ),
    ),
    "llama-8b-h200": _one_gpu(
        "Llama-3.1-8B shape on one 141 GB GPU (H200): trainer and vLLM engine colocated (the engine asleep while the "
        "trainer runs), AdamW's moments in host memory between steps, activations recomputed; bf16 against "
        "fp8-e2e-kv (block-scaled FP8 training, per-channel FP8 rollout weights, FP8 KV cache)",
        shape="llama-8b",
        gpu_memory_utilization=0.55,
    ),
    "llama-3b-h100": _one_gpu(
        "Llama-3.2-3B shape on one 80 GB GPU (H100), the largest Llama shape whose trainer fits beside the engine "
        "there (an 8B trainer's fp32 masters and gradients alone take 64 GB): the llama-8b-h200 layout; bf16 "
        "against fp8-e2e-kv",
        shape="llama-3b",
        gpu_memory_utilization=0.5,
    ),
    "llama-1b-1gpu": BenchPreset(
        "Llama-3.2-1B shape on one GPU, one process: the vLLM engine (CUDA graphs) beside the trainer",
        shape="llama-1b",
        recipes=("bf16", "fp8-e2e", "fp8-e2e-row-kv"),
        prompts=16,
        micro_batch_tokens=4096,
        config={
            "rollout": {"engine": "vllm", "gpu_memory_utilization": 0.3, "enforce_eager": False, "max_model_len": 2048},
            "verify_sync": False,
        },
    ),
}


def get_preset(name: str, field: str = "--preset") -> BenchPreset:
    """The preset ``name``; an unknown name is a UserError naming ``field`` (the option or parameter that gave it)."""
    if name not in PRESETS:
        raise UserError(f"{field}: unknown benchmark preset {name!r}; expected one of {', '.join(PRESETS)}")
    return PRESETS[name]


# the fp8-benchmark pipeline's values where neither a parameter nor a preset gives one: the core recipes
# (``fp8rl.config.CORE_RECIPES``), the tiny model every pipeline starts from by default, 5 timed and 2 warm-up steps
PIPELINE_DEFAULT_MODEL, PIPELINE_DEFAULT_STEPS, PIPELINE_DEFAULT_WARMUP = "tiny", 5, 2

# The fp8-benchmark pipeline's parameters, resolved: each parameter's value when given, else the preset's, else the
# pipeline's default.  An unknown preset is a UserError naming the parameter.


def pipeline_recipes(preset: str, recipes: list[str]) -> list[str]:
    """``recipes`` when non-empty, else the preset's, else the core recipes; every one checked (an unknown recipe is
    a UserError naming it)."""
    from fp8rl.config import CORE_RECIPES, load_recipe

    out = [str(r) for r in recipes] or (list(get_preset(preset, "preset").recipes) if preset else list(CORE_RECIPES))
    for recipe in out:
        load_recipe(recipe)
    return out


def pipeline_model(preset: str, model_source: str) -> str:
    """``model_source`` when non-empty, else the preset's shape as random weights (``shape:<name>``), else the tiny
    model."""
    if model_source:
        return model_source
    return f"shape:{get_preset(preset, 'preset').shape}" if preset else PIPELINE_DEFAULT_MODEL


def pipeline_steps(preset: str, steps: int, warmup_steps: int) -> tuple[int, int]:
    """Timed and warm-up steps: ``steps`` when > 0 and ``warmup_steps`` when >= 0, else the preset's, else 5 and 2."""
    p = get_preset(preset, "preset") if preset else None
    default_steps, default_warmup = (p.steps, p.warmup) if p else (PIPELINE_DEFAULT_STEPS, PIPELINE_DEFAULT_WARMUP)
    return (steps if steps > 0 else default_steps), (warmup_steps if warmup_steps >= 0 else default_warmup)


def preset_config(preset: BenchPreset, config: dict[str, Any]) -> dict[str, Any]:
    """The run-config fields of a ``--config`` file (``config``) on the preset's."""
    return _merged(preset.config, config)
