"""The vLLM rollout engine (``rollout.engine: vllm``): vLLM 0.26 in this process, FP8 or BF16.

FP8 recipes serve a block-FP8 checkpoint with dynamic 1x128 activation groups (DeepSeek
style, ``fp8rl.quant``'s ``block`` granularity) or, with ``rollout.fp8_scaling: channel``, a
per-channel one with dynamic per-token activation scales (compressed-tensors W8A8, ``row``
granularity: vLLM folds that quantization into its fused norm and SiLU kernels, where the block
layout runs separate quantization kernels); a BF16 checkpoint is first converted by
``fp8rl.checkpoint.convert_checkpoint`` (cached under the work dir), so vLLM holds exactly
the bytes ``fp8rl.quant`` makes, and the recipe's BF16 first/last layers are vLLM's
``ignored_layers``.  The ``bf16`` recipe serves the BF16 checkpoint.  Which checkpoint, and
how HF names map to vLLM's fused parameters: ``fp8rl.rollout.vllm_weights``.

Weight updates use vLLM's public calls: ``collective_rpc("reload_weights",
weights_iterator=...)`` with HF names (vLLM fuses q/k/v and gate/up itself and copies
into the tensors it already holds, so CUDA graphs stay valid), then
``reset_prefix_cache()`` -- without it prompt KV blocks computed with the old weights
are reused and outputs diverge from a fresh engine at the first token (measured).
``held_weights`` reads vLLM's fused parameters back and un-fuses them into HF names for
the bit-exact check.  The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
Internals touched: ``fp8rl.rollout.vllm_patches``.

This module imports without vLLM; vLLM is imported when an engine starts.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fp8rl.config import Recipe, RolloutConfig, RunConfig, kv_scales_calibrated, rollout_recipe
from fp8rl.errors import UserError
from fp8rl.models.loading import read_model_config
from fp8rl.models.special_tokens import special_tokens
from fp8rl.quant import QuantizedTensor, quantize_weight
from fp8rl.rollout import vllm_patches
from fp8rl.rollout.base import Rollout, SamplingParams
from fp8rl.rollout.kv_calibration import KVScales, kv_scale_metrics, timed_calibration
from fp8rl.rollout.vllm_tp import tp_layout_problem, tp_shard
from fp8rl.rollout.vllm_weights import (
    Weights,
    fp8_module_names_from_config,
    fused_layout,
    order_by_fused_module,
    partial_tile_note,
    per_channel_layout_problem,
    reload_items,
    row_major,
    serving_checkpoint,
    unfuse_params,
)

# set before vLLM is imported: the engine must live in this process (weights_iterator and
# apply_model pass Python objects); DeepGEMM would JIT ~1,700 kernels for block FP8 (~28 min on
# an H100) where CUTLASS needs none; the FlashInfer sampler is not part of the runtime image.
VLLM_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_DEEP_GEMM": "0",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
}


# ---- starting vLLM ------------------------------------------------------------------------------------
_VLLM_QUANTIZATION = {"block": "fp8", "row": "compressed-tensors"}
# vLLM's cache dtype for rollout.kv_scaling: per-tensor scales fp8rl sets, or scales vLLM computes per token and head
_KV_CACHE_DTYPE = {"tensor": "fp8", "token_head": "fp8_per_token_head"}


def vllm_engine_kwargs(
    checkpoint: str | os.PathLike[str], recipe: Recipe, rollout: RolloutConfig, seed: int = 0, sleep_mode: bool = False
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for a recipe (token-id prompts, no tokenizer)."""
    kwargs: dict[str, Any] = {
        "model": str(checkpoint),
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        # block FP8 is vLLM's "fp8" method; per-channel weights come as a compressed-tensors checkpoint
        "quantization": _VLLM_QUANTIZATION[recipe.quant.granularity] if recipe.rollout_precision == "fp8" else None,
        "seed": seed,
        "gpu_memory_utilization": rollout.gpu_memory_utilization,
        "enforce_eager": rollout.enforce_eager,
        # logprobs of the temperature-scaled distribution (our SamplingParams contract), not raw logits'
        "logprobs_mode": "processed_logprobs",
        "kv_cache_dtype": _KV_CACHE_DTYPE[rollout.kv_scaling] if recipe.kv_cache == "fp8" else "auto",
        "calculate_kv_scales": False,  # per-tensor scales come from fp8rl.rollout.kv_calibration after every update
        "enable_sleep_mode": sleep_mode,
        "enable_prefix_caching": rollout.prefix_caching,
    }
    kwargs |= rollout.engine_kwargs  # none of the keys above (RolloutConfig refuses those)
    backend = rollout.vllm_attention_backend(fp8_cache=recipe.kv_cache == "fp8")
    if backend is not None:
        kwargs["attention_backend"] = backend
    if rollout.max_model_len is not None:
        kwargs["max_model_len"] = rollout.max_model_len
    if rollout.tensor_parallel_size > 1:
        # one engine per process, the processes launched by fp8rl (Ray actors) with RANK, LOCAL_RANK, WORLD_SIZE,
        # MASTER_ADDR/PORT set (fp8rl.cluster.workers); each runs the same requests in lockstep.  vLLM's custom
        # all-reduce maps its peers' memory by device index, which a Ray actor's one-GPU view does not give it
        kwargs |= {
            "tensor_parallel_size": rollout.tensor_parallel_size,
            "distributed_executor_backend": "external_launcher",
            "disable_custom_all_reduce": True,
        }
    return kwargs


def check_engine_kwargs(rollout: RolloutConfig, vllm: Any) -> None:
    """A ``UserError`` naming ``rollout.engine_kwargs.<key>`` when ``vllm.EngineArgs`` has no such argument."""
    known = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    unknown = sorted(set(rollout.engine_kwargs) - known)
    if unknown:
        raise UserError(
            f"rollout.engine_kwargs.{unknown[0]}: not an argument of vLLM {vllm.__version__}'s engine "
            f"(vllm.EngineArgs){f'; nor are {unknown[1:]}' if unknown[1:] else ''}"
        )


def check_attention_backend(name: str | None) -> None:
    """A ``UserError`` naming ``rollout.attention_backend`` when vLLM has no backend of that name."""
    if name is None:
        return
    known = vllm_patches.attention_backend_names()
    if name not in known:
        raise UserError(f"rollout.attention_backend {name!r}: vLLM has no such backend; it has {', '.join(known)}")


def import_vllm() -> Any:
    """Import vLLM for an engine in this process, or raise a ``UserError`` saying what is missing."""
    for key, value in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise UserError(
            "rollout.engine 'vllm' runs vLLM inside this process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 (or unset it)"
        )
    try:
        import vllm
    except ImportError as e:
        raise UserError(
            f"rollout.engine 'vllm' needs vLLM 0.26.x (pip install 'fp8rl[gpu]') but it cannot be imported: {e}; "
            "use rollout.engine 'torch' on machines without it"
        ) from None
    if not torch.cuda.is_available():
        raise UserError("rollout.engine 'vllm' needs a CUDA GPU and none is visible; use rollout.engine 'torch'")
    vllm_patches.check_version(str(vllm.__version__))
    return vllm


# ---- the engine ---------------------------------------------------------------------------------------
class VLLMRolloutEngine:
    """A ``LocalEngine`` on vLLM (see the module docstring); ``model_dir`` is a BF16 or fp8rl FP8 checkpoint."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        recipe: Recipe,
        rollout: RolloutConfig | None = None,
        *,
        seed: int = 0,
        sleep_mode: bool = False,
        work_dir: str | os.PathLike[str] = "work",
        device: str | torch.device = "cuda",
    ) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda" or (self.device.index or 0) != 0:
            raise UserError(
                f"rollout.engine 'vllm' runs on the first visible CUDA device, got device {str(device)!r}; "
                "select the GPU with CUDA_VISIBLE_DEVICES"
            )
        self.rollout = rollout or RolloutConfig()
        # the recipe as served: rollout.fp8_scaling 'channel' makes its quant per-channel ('row')
        self.recipe = recipe = rollout_recipe(recipe, self.rollout)
        # what vLLM would refuse fails here, before a checkpoint is converted for it
        vllm = import_vllm()
        self._vllm = vllm
        check_engine_kwargs(self.rollout, vllm)
        check_attention_backend(self.rollout.vllm_attention_backend(fp8_cache=recipe.kv_cache == "fp8"))
        self._serve(model_dir, work_dir)
        tokens = special_tokens(self.checkpoint)  # config, generation config and tokenizer agree on the stops
        self.stop_token_ids = list(tokens.stop_ids)
        self.eos_token_id, self.pad_token_id = tokens.eos_id, tokens.pad_id
        self.policy_version = 0
        self.asleep = False
        self.sleep_mode = sleep_mode
        self.sleep_freed_bytes: int | None = None  # device memory the last sleep() gave back
        self.kv_scales: dict[int, KVScales] = {}
        self.llm = vllm.LLM(**vllm_engine_kwargs(self.checkpoint, recipe, self.rollout, seed, sleep_mode))
        self.tp_rank = 0  # this process's rank in a tensor-parallel engine: the part vLLM's loaders cut for it
        if self.tp > 1:
            from vllm.distributed import get_tensor_model_parallel_rank

            self.tp_rank = get_tensor_model_parallel_rank()
        self._model = vllm_patches.engine_model(self.llm)
        self._check_layout()

    def _serve(self, model_dir: str | os.PathLike[str], work_dir: str | os.PathLike[str]) -> None:
        """The checkpoint vLLM serves (converted for the recipe when needed), its FP8 modules and tensor-parallel
        layout; a layout vLLM cannot cut fails here."""
        recipe = self.recipe
        self.spec = recipe.quant.spec()
        self.checkpoint = serving_checkpoint(model_dir, recipe, work_dir)
        self.model_config = read_model_config(self.checkpoint)
        self.fp8_modules = fp8_module_names_from_config(self.model_config, recipe)
        self.partial_tile_note = partial_tile_note(self.checkpoint, self.fp8_modules, recipe)
        if self.partial_tile_note:
            print(f"[{recipe.name}] {self.partial_tile_note}", file=sys.stderr, flush=True)
        self._fp8 = {m + ".weight" for m in self.fp8_modules}
        self.tp = self.rollout.tensor_parallel_size
        problem = tp_layout_problem(
            self.model_config, self.tp, recipe.rollout_precision == "fp8" and self.spec.granularity == "block"
        )
        if problem:
            raise UserError(problem)
        self.layout = fused_layout(self.model_config, self.tp)

    @classmethod
    def from_run_config(cls, cfg: RunConfig, model_dir: str | os.PathLike[str], device: str) -> VLLMRolloutEngine:
        """The engine ``fp8rl.build.build_engine`` starts: sleep mode when the Ray layout is colocated."""
        sleep = cfg.ray is not None and cfg.ray.layout == "colocated"
        return cls(
            model_dir, cfg.recipe, cfg.rollout, seed=cfg.seed, sleep_mode=sleep, work_dir=cfg.work_dir, device=device
        )

    def _params(self) -> dict[str, torch.Tensor]:
        """vLLM's parameters by name, FP8 weights as [out, in] views (``row_major``)."""
        return {name: row_major(p.data) for name, p in self._model.named_parameters()}

    def _check_layout(self) -> None:
        """Fail at start, not at the first sync, if vLLM holds the weights in another layout than we un-fuse."""
        if self.spec.granularity == "row":
            raw = {name: p.data for name, p in self._model.named_parameters()}
            problem = per_channel_layout_problem(raw)
            if problem:
                raise vllm_patches.VLLMPatchError(problem)
        params = self._params()
        totals: dict[str, int] = {}
        for s in self.layout.values():
            totals[s.target] = totals.get(s.target, 0) + s.rows
        for target, rows in totals.items():
            got = params.get(target + ".weight")
            if got is None or got.shape[0] != rows:
                raise vllm_patches.VLLMPatchError(
                    f"{target}.weight: expected {rows} fused rows, vLLM holds "
                    f"{None if got is None else tuple(got.shape)}; vLLM's fused layout moved"
                )
        held = self.held_weights()
        for module in self.fp8_modules:
            value = held.get(module + ".weight")
            if not isinstance(value, QuantizedTensor) or value.granularity != self.spec.granularity:
                raise vllm_patches.VLLMPatchError(
                    f"vLLM does not hold {module}.weight as {self.spec.granularity} FP8 [out, in]"
                )

    # ---- weights -------------------------------------------------------------------------------------
    def held_weights(self) -> Weights:
        """What vLLM holds now, under HF names (views of its parameters)."""
        return unfuse_params(self._params(), self.layout, int(self.model_config["vocab_size"]), self.tp_rank)

    def expected_shard(self, name: str, value: torch.Tensor | QuantizedTensor) -> torch.Tensor | QuantizedTensor:
        """What this engine holds of the full weight ``name`` once ``value`` is loaded: ``value`` itself, or with
        tensor parallelism this rank's part of it (``tp_shard``), for the bit-exact check."""
        if self.tp == 1:
            return value
        padded = self._model.get_parameter("model.embed_tokens.weight").shape[0] * self.tp
        return tp_shard(name, value, self.tp_rank, self.tp, padded)

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor | QuantizedTensor], version: int) -> None:
        """Reload ``weights`` (HF names, all or a subset) into the running engine in place, then drop the
        prefix cache.  Parts of a fused module absent from a partial payload are re-sent as held."""
        if self.asleep:
            raise RuntimeError("the rollout engine is asleep (colocated with training); wake_up() first")
        known = self.held_weights()
        payload: Weights = {}
        for name, value in weights.items():
            if name not in known:
                raise KeyError(f"rollout engine has no weight named {name!r}")
            if name in self._fp8 and not isinstance(value, QuantizedTensor):
                value = quantize_weight(value.to(self.device), self.spec)
            elif name not in self._fp8 and isinstance(value, QuantizedTensor):
                raise ValueError(f"{name} is held in bf16 by the engine but an FP8 tensor was sent")
            elif isinstance(value, QuantizedTensor) and value.granularity != self.spec.granularity:
                raise ValueError(
                    f"{name}: the engine serves {self.spec.granularity} FP8 but {value.granularity} FP8 was sent; "
                    "the sync must requantize with the rollout's scaling (rollout.fp8_scaling)"
                )
            payload[name] = value
        if self.tp > 1:
            _, missing = order_by_fused_module(payload, self.layout)
            if missing:  # what is held is this rank's part: it cannot stand in for the full weight vLLM splits
                target, parts = sorted(missing.items())[0]
                raise ValueError(
                    f"rollout.tensor_parallel_size {self.tp}: a tensor-parallel engine reloads fused modules whole, and "
                    f"this payload holds part of {target} without {', '.join(parts)} (a sync must send every part; "
                    "ray.sync 'ipc' and 'objectstore' do)"
                )
        items = reload_items(payload, known, self.layout)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items)})
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after the weight update (requests running?)")
        if self.kv_scales:  # a reload re-runs the attention layers' processing, which may reset them to 1.0
            self.set_kv_scales(self.kv_scales)
        self.policy_version = version

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._params().values())

    # ---- FP8 KV cache --------------------------------------------------------------------------------
    def set_kv_scales(self, scales: Mapping[int, KVScales]) -> None:
        vllm_patches.write_kv_scales(self._model, {i: (s.q, s.k, s.v) for i, s in scales.items()})
        self.kv_scales = dict(scales)

    def calibrate_kv(
        self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> dict[str, float]:
        """Recalibrate the FP8 KV-cache scales from ``model`` (the trainer's policy) over a batch ``[N, L]``
        and return ``kv/...`` metrics; a no-op returning ``{}`` unless the cache has per-tensor FP8 scales
        (``kv_cache: fp8`` with ``rollout.kv_scaling: tensor``)."""
        if not kv_scales_calibrated(self.recipe, self.rollout):
            return {}
        r = self.rollout
        scales, seconds = timed_calibration(
            model, input_ids, attention_mask, position_ids, r.kv_scale_quantile, r.kv_scale_margin
        )
        self.set_kv_scales(scales)
        return kv_scale_metrics(scales, seconds)

    # ---- colocation ----------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Weights to host memory, KV cache dropped (vLLM sleep level 1); needs ``sleep_mode=True``."""
        if not self.sleep_mode:
            raise RuntimeError("this vLLM engine was started without sleep mode (colocated layouts enable it)")
        if not self.asleep:
            free_before = torch.cuda.mem_get_info(self.device)[0]
            self.llm.sleep(level=1)
            # device memory handed to training (weights offloaded, KV cache dropped), as the driver reports it
            self.sleep_freed_bytes = torch.cuda.mem_get_info(self.device)[0] - free_before
        self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
        self.asleep = False

    def close(self) -> None:
        """Shut vLLM down and free its GPU memory (another engine may start in this process afterwards)."""
        vllm_patches.shutdown(self.llm)
        del self._model, self.llm
        vllm_patches.release_memory()

    # ---- generation ----------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, ignore_eos: bool = False) -> Rollout:
        """Sample responses; each token's logprob is vLLM's own (temperature-scaled; after top-k/top-p
        truncation when those are set, vLLM's ``processed_logprobs``).  ``ignore_eos`` is for benchmarks."""
        if self.asleep:
            raise RuntimeError("the rollout engine is asleep (colocated with training); wake_up() first")
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("generate needs at least one non-empty prompt")
        v = self._vllm
        prompts = [v.TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        params = self.request_params(sampling, len(prompt_ids), ignore_eos=ignore_eos)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return rollout_from_outputs(prompt_ids, [o.outputs[0] for o in outputs], self.pad_token_id, self.policy_version)

    def request_params(
        self, sampling: SamplingParams, n: int, ignore_eos: bool = False, flat_logprobs: bool = True
    ) -> list[Any]:
        """vLLM ``SamplingParams`` for ``n`` requests: one seeded stream each (equal prompts sample differently),
        the sampled token's logprob only, as flat lists by default (no dict and ``Logprob`` object per token;
        not measurably faster than the dicts on an H100, docs/benchmarks.md)."""
        ignore_eos = ignore_eos or sampling.ignore_eos
        return [
            self._vllm.SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_tokens=sampling.max_tokens,
                seed=sampling.seed * 1_000_003 + i,
                stop_token_ids=[] if ignore_eos else self.stop_token_ids,
                ignore_eos=ignore_eos,
                logprobs=0,
                flat_logprobs=flat_logprobs,
                detokenize=False,
            )
            for i in range(n)
        ]


def rollout_from_outputs(prompt_ids: list[list[int]], completions: list[Any], pad: int, version: int) -> Rollout:
    """vLLM ``CompletionOutput``s (``token_ids``, ``logprobs``, ``finish_reason``) -> a right-padded ``Rollout``;
    ``finished`` is a stop on EOS (``finish_reason == "stop"``).  ``logprobs`` is vLLM's ``FlatLogprobs`` (what
    ``generate`` asks for) or its list of {token: Logprob} per position."""
    n, width = len(completions), max(1, max(len(c.token_ids) for c in completions))
    ids = torch.full((n, width), pad, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.float32)
    lps = torch.zeros((n, width), dtype=torch.float32)
    for i, c in enumerate(completions):
        tokens = list(c.token_ids)
        ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[i, : len(tokens)] = 1.0
        lps[i, : len(tokens)] = torch.tensor(sampled_logprobs(c.logprobs, tokens), dtype=torch.float32)
    finished = torch.tensor([c.finish_reason == "stop" for c in completions], dtype=torch.bool)
    return Rollout([list(p) for p in prompt_ids], ids, mask, lps, finished, version)


def sampled_logprobs(logprobs: Any, tokens: list[int]) -> list[float]:
    """The logprob vLLM reported for each sampled token, checked against the token it was reported for."""
    if logprobs is None or len(logprobs) != len(tokens):
        raise RuntimeError(f"vLLM returned {len(logprobs or [])} logprobs for {len(tokens)} tokens")
    starts = getattr(logprobs, "start_indices", None)
    if starts is None:  # one {token: Logprob} per position
        return [step[t].logprob for step, t in zip(logprobs, tokens, strict=True)]
    # FlatLogprobs: every position's entries in flat lists, the sampled token's first (vLLM's sampler order)
    flat_ids, flat_lps = logprobs.token_ids, logprobs.logprobs
    if [flat_ids[s] for s in starts] != tokens:
        raise RuntimeError("vLLM's flat logprobs do not start with the sampled tokens at every position")
    return [flat_lps[s] for s in starts]
