"""Typed configuration: precision recipes and the RL run.  Imports no torch, so tooling can load it cheaply.

A recipe is the axis every comparison is made along:

| recipe        | rollout | training |
|---------------|---------|----------|
| `bf16`        | BF16    | BF16     |
| `fp8-rollout` | FP8     | BF16     |
| `fp8-e2e`     | FP8     | FP8 (the same scaling as rollout) |

Recipes are YAML files validated by these models; an invalid value is a
``ConfigError`` naming the field and the allowed values before anything runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fp8rl.errors import UserError

if TYPE_CHECKING:
    from fp8rl.quant import QuantSpec

RECIPE_DIR = Path(__file__).parent / "recipes"
BUILTIN_RECIPES = ("bf16", "fp8-rollout", "fp8-e2e")


class ConfigError(UserError, ValueError):
    """A config or recipe file is invalid; the message names the field(s)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QuantConfig(_Strict):
    """How FP8 is applied (shared by rollout and, for fp8-e2e, training)."""

    granularity: Literal["block", "row", "tensor"] = "block"
    fmt: Literal["e4m3"] = "e4m3"
    weight_block: tuple[int, int] = (128, 128)
    act_block: int = Field(128, ge=1)
    pow2_scales: bool = False
    bf16_first_layers: int = Field(0, ge=0)
    bf16_last_layers: int = Field(0, ge=0)

    @property
    def fixed_128_blocks(self) -> bool:
        """128x128 weight tiles and 1x128 activation groups: the one block layout TE and vLLM run."""
        return tuple(self.weight_block) == (128, 128) and self.act_block == 128

    def spec(self) -> QuantSpec:
        """These settings as the ``fp8rl.quant.QuantSpec`` the quantizers take (imports torch when called)."""
        from fp8rl.quant import QuantSpec

        return QuantSpec(
            granularity=self.granularity,
            fmt=self.fmt,
            weight_block=self.weight_block,
            act_block=self.act_block,
            pow2_scales=self.pow2_scales,
        )


class NoCorrection(_Strict):
    """No mismatch correction: every token weighs 1 (``fp8rl.rl.mismatch_correction``)."""

    type: Literal["none"] = "none"


class TISCorrection(_Strict):
    """Truncated importance sampling: w = min(rho, threshold), rho = exp(lp_train - lp_rollout).

    level:     "token" uses rho_t; "sequence" uses prod_t rho_t for every token of the sequence.
    threshold: C, the cap on the weight (Yao et al. use single-digit caps; 2 keeps the variance
               low while leaving room above 1).
    """

    type: Literal["tis"] = "tis"
    level: Literal["token", "sequence"] = "token"
    threshold: float = Field(2.0, gt=1.0)


class MISCorrection(_Strict):
    """Masked importance sampling: drop tokens (or sequences) whose ratio leaves [low, high].

    level:     as TIS.
    low, high: the window of ratios kept; it contains 1, so an on-policy token is never dropped.
               0.5 and 2.0 make it symmetric in log space, |log rho| <= log 2.
    """

    type: Literal["mis"] = "mis"
    level: Literal["token", "sequence"] = "token"
    low: float = Field(0.5, gt=0.0, lt=1.0)
    high: float = Field(2.0, gt=1.0)


Correction = Annotated[NoCorrection | TISCorrection | MISCorrection, Field(discriminator="type")]


LossAgg = Literal["token-mean", "seq-mean-token-mean"]


class GRPOConfig(_Strict):
    """GRPO as a configuration of PPO-clip (defaults: DAPO clip-higher and token-mean aggregation).

    group_size responses per prompt, prompts_per_step prompts a step; std_normalize and
    leave_one_out shape the advantages (``fp8rl.rl.grpo_advantages``).  The rest is the loss
    (``fp8rl.rl.policy_loss``):

    clip_low:  ratio is clipped below at ``1 - clip_low``; 0.2 as PPO (Schulman et al. 2017) and GRPO.
    clip_high: ratio is clipped above at ``1 + clip_high``; 0.28 is DAPO's "clip-higher" (Yu et al.
               2025), which leaves low-probability tokens room to grow and so delays entropy
               collapse.  Set 0.2 for PPO/GRPO.
    dual_clip: ``None`` (off), or the constant ``c > 1`` of dual-clip PPO (Ye et al. 2020,
               "Mastering Complex Control in MOBA Games"): for negative advantages the per-token
               loss is capped at ``-c * A``.  3.0 (``fp8rl.rl.DUAL_CLIP_YE_ET_AL``) is the paper's
               and veRL's value.
    loss_agg:  "token-mean" averages over every valid token of the batch (DAPO; veRL
               ``loss_agg_mode``'s default), so long responses weigh in per token;
               "seq-mean-token-mean" averages each sequence's tokens and then the sequences
               (original GRPO), so every response weighs the same.
    kl_coef:   weight of the k3 KL(pi || pi_ref) penalty (GRPO's beta); 0 (off) as DAPO and
               Dr. GRPO.  Needs reference log-probs when non-zero.
    """

    group_size: int = Field(8, ge=2)
    prompts_per_step: int = Field(32, ge=1)
    clip_low: float = Field(0.2, ge=0.0, lt=1.0)
    clip_high: float = Field(0.28, ge=0.0)
    dual_clip: float | None = Field(None, gt=1.0)
    loss_agg: LossAgg = "token-mean"
    kl_coef: float = Field(0.0, ge=0.0)
    std_normalize: bool = True
    leave_one_out: bool = False


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(8, ge=1)
    # benchmarks: generate max_tokens for every response (the rewards still score what was generated)
    ignore_eos: bool = False


class OptimConfig(_Strict):
    # tuned on the tiny model (docs/rl.md); billion-parameter LLMs use ~1e-6 (veRL, NeMo RL GRPO recipes)
    lr: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0.0)
    warmup_steps: int = Field(10, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    micro_batch_size: int = Field(64, ge=1)
    # set: cut micro-batches by padded tokens (rows x width, padding columns common to all rows dropped)
    # instead of micro_batch_size rows: what keeps long responses within memory
    micro_batch_tokens: int | None = Field(None, ge=1)
    # recompute each decoder layer's activations in the backward instead of keeping them (long responses)
    activation_checkpointing: bool = False
    # AdamW's two moments (8 bytes a parameter, over the ranks when sharded) in host memory between steps, copied
    # back for each step (fp8rl.train.optim.StateOffload): room for the colocated rollout engine, at two copies a step
    offload_optimizer_state: bool = False
    # the decoder's RMSNorms, SiLU gate and rotary embedding as torch.compile kernels, in every precision
    # (fp8rl.train.compiled: Llama / Qwen2 / Qwen3 / Mistral modules; same math, fused)
    compile_elementwise: bool = False
    # FSDP2 (ray.trainer_sharding fsdp) with FP8 linears (torch trainer): gather each decoder layer's weights once
    # per optimizer step, not for every micro-batch's forward and backward -- the FP8 linears quantize them once
    # and free the bf16 copy, their cached FP8 copies serve every micro-batch (fp8rl.train.trainer). false: FSDP2's
    # default, a gather per forward and per backward
    fp8_gather_once: bool = True
    # FSDP2 (ray.trainer_sharding fsdp): accumulate the micro-batches' gradients unsharded in fp32 on every rank
    # (FSDP2's accumulators: 4 bytes a parameter of the whole model, Megatron's gradient buffer) and reduce-scatter them
    # once a step, in the last micro-batch's backward, instead of after every micro-batch: 1/N of the reduce-scatter
    # traffic, and no layer's backward waits on the previous layer's reduce-scatter in the others
    reduce_grads_once: bool = False
    # the decoder layers replayed as CUDA graphs (fp8rl.train.graphs; torch trainer on a GPU, not sharded):
    # micro-batches padded to widths in steps of cuda_graph_width and the rows the token budget gives there,
    # each shape captured once seen before (by a forward with gradients on); cuda_graph_shapes kept (least used
    # dropped), each holding one micro-batch's activations and a bf16 copy of the decoder's gradients
    cuda_graphs: bool = False
    cuda_graph_width: int = Field(128, ge=16)
    cuda_graph_shapes: int = Field(2, ge=1)


class _PromptOptions(_Strict):
    # auto: the tokenizer's chat template when it has one; always: it or an error; never: raw text
    # (fp8rl.tasks.prompts)
    chat_template: Literal["auto", "always", "never"] = "auto"
    system_prompt: str | None = None


class ArithmeticTaskConfig(_PromptOptions):
    """The built-in synthetic task (``fp8rl.tasks.ArithmeticTask``)."""

    type: Literal["arithmetic"] = "arithmetic"
    max_operand: int = Field(20, ge=1)
    operators: tuple[Literal["+", "-", "*"], ...] = ("+", "-")
    num_operands: int = Field(2, ge=2)


class TaskFields(_Strict):
    """Column names of a record's prompt, answer and chat messages (GSM8K: ``prompt: question``)."""

    prompt: str = "prompt"
    answer: str = "answer"
    messages: str = "messages"


class JsonlTaskConfig(_PromptOptions):
    """Users' own data: JSON Lines (``type: jsonl``) or Parquet (``type: parquet``) files of records
    ``{"prompt" | "messages", "answer", ...}`` (``fp8rl.tasks.load_examples``)."""

    type: Literal["jsonl", "parquet"]
    train: str
    test: str
    fields: TaskFields = TaskFields()


class ExactMatchRewardConfig(_Strict):
    """1.0 when the answer extracted from the response equals the reference (``fp8rl.tasks.rewards``)."""

    type: Literal["exact-match"] = "exact-match"
    extract: Literal["strict", "last-number", "boxed", "gsm8k"] = "strict"


class PythonRewardConfig(_Strict):
    """``name(response, answer, example) -> float`` from ``function: "path/to/file.py:name"``."""

    type: Literal["python"]
    function: str = Field(pattern=r"^.+\.py:[A-Za-z_][A-Za-z0-9_]*$")
    timeout_s: float = Field(10.0, gt=0)
    workers: int = Field(4, ge=1)


RewardConfig = Annotated[ExactMatchRewardConfig | PythonRewardConfig, Field(discriminator="type")]


TaskConfig = Annotated[ArithmeticTaskConfig | JsonlTaskConfig, Field(discriminator="type")]


class Recipe(_Strict):
    """A precision recipe: what is FP8 where, how it is scaled, and how mismatch is corrected."""

    name: str
    rollout_precision: Literal["bf16", "fp8"]
    train_precision: Literal["bf16", "fp8"]
    quant: QuantConfig = QuantConfig()
    correction: Correction = NoCorrection()
    # training backend: torch (fp8rl's own FP8 linear, portable, exact on CPU) or te (TransformerEngine, GPU)
    trainer: Literal["torch", "te"] = "torch"
    # te only: auto maps granularity block -> Float8BlockScaling, tensor -> Float8CurrentScaling;
    # delayed -> DelayedScaling (per tensor, amax history), for granularity tensor
    te_recipe: Literal["auto", "delayed"] = "auto"
    # KV cache of the rollout engine (vllm only): the model dtype, or FP8 with scales recalibrated every step
    kv_cache: Literal["bf16", "fp8"] = "bf16"

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        if self.train_precision == "fp8" and self.rollout_precision != "fp8":
            raise ValueError("train_precision 'fp8' requires rollout_precision 'fp8' (end-to-end FP8)")
        q = self.quant
        if self.trainer == "te" and self.train_precision == "fp8":
            if q.granularity == "row":
                raise ValueError(
                    "trainer 'te' has no per-row FP8 recipe on Hopper (MXFP8 needs Blackwell); "
                    "use quant.granularity 'block' or 'tensor', or trainer 'torch'"
                )
            if q.granularity == "block" and not q.fixed_128_blocks:
                raise ValueError(
                    "trainer 'te' block scaling is fixed at 128x128 weight tiles and 1x128 activation groups; "
                    f"got quant.weight_block {list(q.weight_block)}, quant.act_block {q.act_block}"
                )
        if self.te_recipe == "delayed" and (self.trainer != "te" or q.granularity != "tensor"):
            raise ValueError("te_recipe 'delayed' needs trainer 'te' and quant.granularity 'tensor'")
        if self.te_recipe == "delayed" and q.pow2_scales:
            raise ValueError(
                "te_recipe 'delayed' (DelayedScaling) has no power-of-two scale option: set quant.pow2_scales "
                "false, or te_recipe 'auto' (Float8CurrentScaling) for power-of-two per-tensor scales"
            )
        return self


class RayConfig(_Strict):
    """The RL step on Ray (``fp8rl.cluster``): workers, layout, where Ray is, and the fault limits."""

    trainer_workers: int = Field(1, ge=1)
    rollout_workers: int = Field(1, ge=1)
    # replicate: every trainer worker holds the whole model, fp32 masters and AdamW state (data parallel);
    # fsdp: FSDP2 shards the fp32 masters and AdamW state across the trainer workers (fp8rl.train.trainer)
    trainer_sharding: Literal["replicate", "fsdp"] = "replicate"
    # split: rollout and training on different devices; colocated: shared, time-sliced
    layout: Literal["split", "colocated"] = "split"
    # None: RAY_ADDRESS if set, else a local Ray started (and stopped) by the step
    address: str | None = None
    # every blocking wait on a worker gives up after this long, naming the worker
    actor_timeout_s: float = Field(600.0, gt=0)
    # a dead worker is replaced and the run resumes from its last checkpoint, at most this often
    max_restarts: int = Field(2, ge=0)
    object_store_mb: int = Field(512, ge=64)
    # weight sync trainer rank 0 -> rollout workers: through the Ray object store, a bucketed broadcast
    # over a process group of its own (NCCL on GPUs, gloo on CPUs; fp8rl.sync.nccl), or CUDA IPC
    # (colocated on GPUs: rollout worker i maps trainer rank i's packed payload on their GPU; fp8rl.sync.ipc;
    # sharded, every rank gathers and ranks 0 .. rollout_workers-1 keep the full weights for their engine)
    sync: Literal["objectstore", "collective", "ipc"] = "objectstore"
    sync_bucket_mb: int = Field(256, ge=1)
    # colocated: after loading new weights (and recalibrating an FP8 KV cache) the engines go back to sleep until the
    # next generation; false keeps them awake from the load to that generation: one sleep and one wake-up fewer a step
    # (vLLM's level-1 sleep copies the weights to host memory and its wake-up copies them back). The trainer's KV
    # calibration forward then runs beside the awake engines; they are put to sleep before a checkpoint gathers the
    # trainer state (which brings an offloaded optimizer state back to the GPU)
    sleep_after_sync: bool = True

    @model_validator(mode="after")
    def _ipc_needs_a_trainer_rank_per_engine(self) -> RayConfig:
        if self.sync != "ipc":
            return self
        if self.layout != "colocated":
            raise ValueError(
                "ray.sync 'ipc' maps the trainer's GPU memory into the rollout worker on the same GPU: "
                "it needs ray.layout 'colocated' (split layouts use 'collective' or 'objectstore')"
            )
        if self.rollout_workers > self.trainer_workers:
            raise ValueError(
                "ray.sync 'ipc' pairs rollout worker i with trainer rank i on one GPU: ray.rollout_workers "
                f"({self.rollout_workers}) must not exceed ray.trainer_workers ({self.trainer_workers})"
            )
        return self


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


class RolloutConfig(_Strict):
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
    engine_kwargs: dict[str, Any] = {}

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


class RunConfig(_Strict):
    """One RL run: a recipe plus everything else the loop needs."""

    recipe: Recipe
    model: str | None = None  # None: the tiny model, warmed up by SFT
    preset: str = "tiny"
    task: TaskConfig = ArithmeticTaskConfig()
    reward: RewardConfig = ExactMatchRewardConfig()
    steps: int = Field(60, ge=1)
    seed: int = 0
    grpo: GRPOConfig = GRPOConfig()
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    optim: OptimConfig = OptimConfig()
    eval_every: int = Field(5, ge=1)
    eval_examples: int = Field(200, ge=1)
    # held-out avg@k at the rollout temperature, besides greedy accuracy; 0 turns it off
    eval_samples: int = Field(4, ge=0)
    verify_sync: bool = True
    # save the loop state every N steps (and at the end) when the run has a checkpoint dir; 0: never
    checkpoint_every: int = Field(0, ge=0)
    # None: the loop runs in this process; set: on Ray actors
    ray: RayConfig | None = None
    work_dir: str = "work"
    experiment: str = "fp8rl"

    @model_validator(mode="after")
    def _engine_supports_recipe(self) -> RunConfig:
        if self.recipe.kv_cache == "fp8" and self.rollout.engine != "vllm":
            raise ValueError(
                "recipe.kv_cache 'fp8' needs rollout.engine 'vllm' (the torch engine keeps a bf16 KV cache)"
            )
        if self.recipe.te_recipe == "delayed" and self.optim.activation_checkpointing:
            raise ValueError(
                "recipe.te_recipe 'delayed' (DelayedScaling) cannot be combined with optim.activation_checkpointing: "
                "the recompute would update its amax history a second time (use te_recipe 'auto')"
            )
        if self.optim.reduce_grads_once and (self.ray is None or self.ray.trainer_sharding != "fsdp"):
            raise ValueError(
                "optim.reduce_grads_once applies to ray.trainer_sharding 'fsdp' (a replicated trainer already "
                "accumulates every micro-batch and reduces once a step)"
            )
        tp = self.rollout.tensor_parallel_size
        if tp > 1 and (self.rollout.engine != "vllm" or self.ray is None):
            raise ValueError(
                f"rollout.tensor_parallel_size {tp} splits a vLLM engine over Ray rollout workers: it needs "
                "rollout.engine 'vllm' and a ray section (the one-process loop and the torch engine run one device)"
            )
        if tp > 1 and self.ray is not None and self.ray.sync == "collective":
            raise ValueError(
                f"rollout.tensor_parallel_size {tp} needs ray.sync 'ipc' or 'objectstore': the bucketed broadcast "
                "('collective') may cut a fused module between buckets and checks full shapes, where each rank of a "
                "tensor-parallel engine holds its part"
            )
        if self.ray is not None and self.ray.rollout_workers % tp:
            raise ValueError(
                f"ray.rollout_workers ({self.ray.rollout_workers}) must be a multiple of rollout.tensor_parallel_size "
                f"({tp}): each engine takes that many workers"
            )
        served = rollout_recipe(self.recipe, self.rollout)
        problem = vllm_recipe_problem(served) if self.rollout.engine == "vllm" else None
        if problem:
            raise ValueError(problem)
        return self


def rollout_recipe(recipe: Recipe, rollout: RolloutConfig) -> Recipe:
    """``recipe`` as the rollout engine serves it: with ``rollout.fp8_scaling: channel`` its quant granularity is
    ``row`` (per output channel, ``fp8rl.quant``'s name), whatever the trainer's; otherwise ``recipe`` itself.
    The engine's checkpoint, its FP8 modules and every sync's requantization follow this recipe."""
    if rollout.fp8_scaling == "channel" and recipe.rollout_precision == "fp8":
        return recipe.model_copy(update={"quant": recipe.quant.model_copy(update={"granularity": "row"})})
    return recipe


def vllm_recipe_problem(recipe: Recipe) -> str | None:
    """Why vLLM cannot serve ``recipe``, or None: it serves bf16, and FP8 as 128x128 / 1x128 block scaling or
    per-channel (``row``) weight scales with per-token activation scales (compressed-tensors W8A8)."""
    if recipe.rollout_precision != "fp8":
        return None
    q = recipe.quant
    if q.granularity == "row":
        return None
    if q.granularity != "block":
        return (
            f"rollout.engine 'vllm' serves FP8 as block or per-channel scaling; recipe {recipe.name!r} has "
            f"recipe.quant.granularity {q.granularity!r} (use 'block' or 'row', rollout.fp8_scaling 'channel', "
            "or rollout.engine 'torch')"
        )
    if not q.fixed_128_blocks:
        return (
            "rollout.engine 'vllm' runs block FP8 with 128x128 weight tiles and 1x128 activation groups; "
            f"recipe.quant.weight_block is {list(q.weight_block)}, recipe.quant.act_block {q.act_block}"
        )
    return None


def format_validation_errors(e: ValidationError, source: str, what: str = "configuration") -> str:
    """``<source>: invalid <what>`` and one indented ``field.path: message`` line per error."""
    lines = [f"{source}: invalid {what}"]
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        lines.append(f"  {loc or '(root)'}: {err['msg']}")
    return "\n".join(lines)


def parse_recipe(data: Any, source: str = "recipe") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_errors(e, source)) from None


def load_recipe(name_or_path: str) -> Recipe:
    """A built-in recipe by name (``bf16``, ``fp8-rollout``, ``fp8-e2e``) or a YAML file."""
    path = RECIPE_DIR / f"{name_or_path}.yaml" if name_or_path in BUILTIN_RECIPES else Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"recipe {name_or_path!r}: not a built-in recipe {list(BUILTIN_RECIPES)} nor a file")
    return parse_recipe(read_yaml(path), str(path))


def read_yaml(path: Path, mapping_of: str | None = None) -> Any:
    """The YAML document in ``path`` (which exists); a ``ConfigError`` naming the file if it is not valid YAML or,
    with ``mapping_of``, not a mapping (``mapping_of`` says of what, for the message)."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if mapping_of is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: {mapping_of}, got {type(data).__name__}")
    return data


def load_run_config_data(path: str | Path) -> dict[str, Any]:
    """The mapping in a run-config YAML file (validated later, once flags are merged over it)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: run config file not found")
    data: dict[str, Any] = read_yaml(path, mapping_of="a run config must be a mapping of RunConfig fields")
    return data


def parse_run_config(data: Any, source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_errors(e, source)) from None
