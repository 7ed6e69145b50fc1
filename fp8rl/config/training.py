"""The RL objective (GRPO / PPO-clip), sampling and the optimizer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fp8rl.config.base import Strict

LossAgg = Literal["token-mean", "seq-mean-token-mean"]


class GRPOConfig(Strict):
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
    old_logprobs: where the old (behaviour) policy's logprobs of the PPO ratio come from.
               "train_forward" (default): the policy step's own forward, detached.  Exact here: one
               optimizer step consumes the whole rollout batch (one PPO iteration, one mini-batch), so
               the policy before the update is the behaviour policy and the ratio is 1 (TRL skips the
               recompute when num_iterations == 1).  "recompute": a separate no-grad forward over the
               batch before the step (the same update; one forward more).  ``fp8rl.train.old_logprobs``.
    """

    group_size: int = Field(8, ge=2)
    prompts_per_step: int = Field(32, ge=1)
    clip_low: float = Field(0.2, ge=0.0, lt=1.0)
    clip_high: float = Field(0.28, ge=0.0)
    dual_clip: float | None = Field(None, gt=1.0)
    loss_agg: LossAgg = "token-mean"
    kl_coef: float = Field(0.0, ge=0.0)
    old_logprobs: Literal["train_forward", "recompute"] = "train_forward"
    std_normalize: bool = True
    leave_one_out: bool = False


class SamplingConfig(Strict):
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(8, ge=1)
    # benchmarks: generate max_tokens for every response (the rewards still score what was generated)
    ignore_eos: bool = False


class OptimConfig(Strict):
    # tuned on the tiny model (docs/rl.md); billion-parameter LLMs use ~1e-6 (veRL, NeMo RL GRPO recipes)
    lr: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0.0)
    # a step whose gradient norm is NaN or infinite skips its update (the fp32 masters stay as they were) and is
    # counted (train/nonfinite_steps); this many such steps in a row end the run with an error (it would otherwise
    # go on rolling out an unchanged policy and end FINISHED)
    max_nonfinite_steps: int = Field(3, ge=1)
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
    # FP8 training only where it pays: a decoder linear whose forward GEMM over one micro-batch (2 x
    # micro_batch_tokens x in_features x out_features FLOP) is under this many GFLOP trains in BF16. There the FP8
    # linear's quantization kernels and launches cost more than its GEMMs save: measured eager forward + backward on
    # H100/H200, 1.04-1.37x BF16 from ~520 GFLOP up, 0.70-0.77x at 130-275 GFLOP (docs/benchmarks.md, "Where FP8
    # training pays"). A speed setting of the torch and TE trainers: the rollout engine serves the recipe's FP8 as
    # before, and the layers it leaves in BF16 count as BF16 in the run's FP8 linear counts. 0: every decoder linear
    # the recipe puts in FP8 trains in FP8. Needs micro_batch_tokens (the GEMMs' rows)
    fp8_min_gemm_gflop: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _min_gemm_needs_token_micro_batches(self) -> OptimConfig:
        if self.fp8_min_gemm_gflop > 0 and self.micro_batch_tokens is None:
            raise ValueError(
                "optim.fp8_min_gemm_gflop compares each linear's GEMM over a micro-batch of optim.micro_batch_tokens "
                "tokens: set optim.micro_batch_tokens"
            )
        return self
