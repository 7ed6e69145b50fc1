"""The torch training backend: BF16 or FP8 linears, fp32 master weights, micro-batched policy updates.

Logprobs are recomputed here under TRAINING numerics; for ``fp8`` the decoder linears run
forward, dgrad and wgrad in FP8 (``FP8TrainLinear``) with the recipe's scaling, while
embeddings, lm_head, norms, attention math and the configured BF16 layers stay BF16.

Sharding.  ``sharding="replicate"`` (default): this process holds the whole model in bf16 with
fp32 masters and AdamW state (``MasterWeightAdamW``; data-parallel ranks sum their gradients
through ``grad_reducer``).  ``sharding="fsdp"``: FSDP2 (``fully_shard`` on every decoder layer
and the model) over the process group the caller made; the parameters are the fp32 masters,
sharded, AdamW state sharded with them (``ShardedAdamW``), bf16 compute and fp32 gradient
reduction (``MixedPrecisionPolicy``), the gradient SUMMED across ranks as the replicated path
sums it.  Every rank must then make the same calls in the same order: forwards, backwards,
``hf_state_dict``, ``state_dict`` and ``save_checkpoint`` are collectives.  FSDP2 reduce-scatters each
micro-batch's gradients in its backward; with ``reduce_grads_once`` the micro-batches accumulate them unsharded in
fp32 and the last one's backward reduce-scatters the sum (the replicated path's one reduction a step).  What is
sharded how, what stays gathered and what each micro-batch's backward is told: ``fp8rl.train.fsdp``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel

from fp8rl.config import GRPOConfig, OptimConfig
from fp8rl.models.layers import drop_small_gemms, fp8_module_names, swap_modules
from fp8rl.models.loading import load_causal_lm
from fp8rl.quant import QuantSpec
from fp8rl.rl import PolicyLossInput, policy_loss_stats, stats_row
from fp8rl.rollout.kv_calibration import KVScales, timed_calibration
from fp8rl.train.batches import MicroBatcher, SequenceBatch
from fp8rl.train.batches import build_batch as build_batch  # re-exported: the trainer's callers build batches
from fp8rl.train.batches import policy_batch_totals as policy_batch_totals
from fp8rl.train.compiled import compile_elementwise
from fp8rl.train.fp8_linear import FP8TrainLinear, checkpoint_contexts
from fp8rl.train.fsdp import FSDPUnits
from fp8rl.train.graphs import LayerGraphs
from fp8rl.train.model_inputs import causal_padding_mask, no_mask_sdpa, prepares_masks, to_device, unpadded
from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld, TrainForwardOld
from fp8rl.train.optim import MasterWeightAdamW, ShardedAdamW, lr_lambda
from fp8rl.train.step_memory import StepMemory
from fp8rl.train.step_profile import StepProfile, profiled_step
from fp8rl.train.token_logprobs import token_logprobs
from fp8rl.train.weights import TrainerWeights

SHARDINGS = ("replicate", "fsdp")


@dataclass(frozen=True)
class TrainerOptions:
    """What a trainer is built with: the recipe's training precision and scaling, the schedule's length, the
    sharding, and ``optim`` -- the run config's ``OptimConfig`` itself, the one source of the optimizer, micro-batch
    and memory settings (``fp8rl.build.trainer_options``)."""

    precision: str = "bf16"  # bf16 | fp8
    spec: QuantSpec = field(default_factory=QuantSpec)
    backend: str = "torch"  # torch | te (fp8rl.train.te_trainer)
    te_recipe: str = "auto"  # te: auto | delayed (fp8rl.config.Recipe.te_recipe)
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    total_steps: int = 100
    sharding: str = "replicate"  # replicate | fsdp (see the module docstring)
    optim: OptimConfig = field(default_factory=OptimConfig)


def fp8_linear_names(model: torch.nn.Module, opts: TrainerOptions) -> list[str]:
    """The decoder linears an FP8 trainer runs in FP8: the recipe's (its BF16 first / last layers left out), less
    those whose GEMM over a micro-batch is too small to pay for FP8 (``optim.fp8_min_gemm_gflop``)."""
    names = fp8_module_names(model, opts.bf16_first_layers, opts.bf16_last_layers)
    tokens = opts.optim.micro_batch_tokens or 0
    return drop_small_gemms(model, names, tokens, opts.optim.fp8_min_gemm_gflop)


def _check_options(opts: TrainerOptions) -> None:
    """The settings a ``TorchTrainer`` refuses (``ValueError`` naming the setting)."""
    if opts.precision not in ("bf16", "fp8"):
        raise ValueError(f"trainer precision must be 'bf16' or 'fp8', got {opts.precision!r}")
    if opts.sharding not in SHARDINGS:
        raise ValueError(f"trainer sharding must be one of {SHARDINGS}, got {opts.sharding!r}")
    if opts.optim.reduce_grads_once and opts.sharding != "fsdp":
        raise ValueError("reduce_grads_once applies to sharding 'fsdp' (replicated, the gradients reduce once)")


class TorchTrainer(TrainerWeights):
    def __init__(self, model: str | os.PathLike[str] | PreTrainedModel, opts: TrainerOptions, device: str = "cpu"):
        _check_options(opts)
        self.sharded = opts.sharding == "fsdp"
        # sharded: loaded on the CPU; fully_shard moves each rank's shard (only) to the device
        load_on = "cpu" if self.sharded else device
        if isinstance(model, PreTrainedModel):
            self.model = model.to(device=load_on, dtype=torch.bfloat16)  # type: ignore[call-arg]
        else:
            self.model = load_causal_lm(model, dtype=torch.bfloat16, device=load_on)
        self.model.train()
        self.device = torch.device(device)
        self.opts = opts
        self._masks = prepares_masks(self.model.config)  # fp8rl.train.model_inputs
        self.fp8_modules: list[str] = self._convert_linears()
        self.compiled_modules: list[str] = compile_elementwise(self.model) if opts.optim.compile_elementwise else []
        self.graphs = self._layer_graphs() if opts.optim.cuda_graphs else None
        if opts.optim.activation_checkpointing:
            # checkpoint_contexts: the FP8 linears skip, in a layer's first forward, the copies only its backward reads
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": self._checkpoint_contexts}
            )
        self.fsdp: FSDPUnits | None = None
        if self.sharded:
            self.fsdp = FSDPUnits(self.model, self.device, opts.optim.fp8_gather_once)
        optimizer = ShardedAdamW if self.sharded else MasterWeightAdamW
        self.optimizer: MasterWeightAdamW | ShardedAdamW = optimizer(
            list(self.model.parameters()), lr=opts.optim.lr, betas=opts.optim.betas, weight_decay=opts.optim.weight_decay,
            offload_state=opts.optim.offload_optimizer_state,
        )  # fmt: skip
        self.step_memory = StepMemory(self.device, self.optimizer.offload)  # a policy step's memory costs
        self.step_profile = StepProfile(self.device)  # on request, a policy step's kernel time by category
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer.optimizer, lr_lambda(opts.optim.warmup_steps, opts.total_steps, opts.optim.schedule)
        )
        self.pad_token_id = int(self.model.config.pad_token_id or 0)
        # with CUDA graphs, micro-batches are padded to shape buckets: widths in steps of cuda_graph_width columns
        self.micro = MicroBatcher(
            opts.optim.micro_batch_size, opts.optim.micro_batch_tokens, opts.optim.cuda_graph_width if opts.optim.cuda_graphs else None,
            self.pad_token_id, self.sharded, self.device,
        )  # fmt: skip
        self.step_count = 0
        self._tokens = [0.0, 0.0]  # (computed, valid) tokens of the current policy step's forwards

    def _layer_graphs(self) -> LayerGraphs:
        """``optim.cuda_graphs``: the decoder layers' graphs, after checking what the option needs."""
        o = self.opts.optim
        if self.opts.backend != "torch":
            raise ValueError(f"optim.cuda_graphs needs trainer 'torch', got {self.opts.backend!r}")
        if self.sharded:
            raise ValueError("optim.cuda_graphs cannot be combined with ray.trainer_sharding 'fsdp'")
        if o.activation_checkpointing:
            raise ValueError("optim.cuda_graphs cannot be combined with optim.activation_checkpointing")
        if o.cuda_graph_width < 1:
            raise ValueError(f"optim.cuda_graph_width must be >= 1, got {o.cuda_graph_width}")
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
            raise ValueError(f"optim.cuda_graphs: {type(self.model).__name__} has no decoder layers at model.layers")
        if self.device.type != "cuda":
            raise ValueError(f"optim.cuda_graphs needs a CUDA device; this trainer runs on {str(self.device)!r}")
        return LayerGraphs(layers, o.cuda_graph_shapes, self._prepare_linears)

    def _prepare_linears(self) -> None:
        for m in self.model.modules():
            if isinstance(m, FP8TrainLinear):
                m.prepare()

    def _optimizer_step(self, grad_scale: float = 1.0) -> float:
        """Scale the summed gradients by ``grad_scale`` (where not 1), clip and step (the pre-clip grad norm).  The
        FP8 linears' cached weight operands describe the weights being replaced: without CUDA graphs they go before
        the step, so they do not sit beside AdamW's state at its peak (2 bytes a parameter, of the whole model under
        FSDP2, where each rank caches the gathered weights); with CUDA graphs they are requantized into their
        buffers after it."""
        if self.graphs is None:
            self._weights_changed()
        grad_norm = self.optimizer.step(self.opts.optim.grad_clip, grad_scale)
        if self.graphs is not None:
            self._weights_changed()
        return grad_norm

    def _weights_changed(self) -> None:
        """After an optimizer step or a load: FP8 linears drop their cached FP8 weights (with CUDA graphs, which
        read those buffers, requantize into them)."""
        for m in self.model.modules():
            if isinstance(m, FP8TrainLinear):
                if self.graphs is not None:
                    m.refresh_weight()
                else:
                    m.weights_changed()
        self._reshard_held()

    def _reshard_held(self) -> None:
        if self.fsdp is not None:
            self.fsdp.reshard_held()

    def _checkpoint_contexts(self) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        """The ``context_fn`` of the activation checkpointing: (a layer's first forward's, its recompute's)."""
        return checkpoint_contexts()

    def _update_slices(self, batch: SequenceBatch) -> Iterator[slice]:
        """The micro-batches of an optimizer step; sharded, FSDP2 is told before each whether its backward ends the
        step (``FSDPUnits.before_backward``).  Every rank runs the same number of micro-batches
        (``MicroBatcher.slices``), each with a backward, so the collectives match."""
        slices = self.micro.slices(batch)
        for i, sl in enumerate(slices):
            if self.fsdp is not None:
                self.fsdp.before_backward(i, len(slices), self.opts.optim.reduce_grads_once)
            yield sl

    def _padding_pass(self, like: SequenceBatch, temperature: float) -> torch.Tensor:
        """A forward of ``MicroBatcher.padding_batch``: every token it computes is waste (counted computed, not valid)."""
        valid = self._tokens[1]
        lp = self._response_logprobs(self.micro.padding_batch(like), temperature)
        self._tokens[1] = valid
        return lp

    # ---- backend hooks (TETrainer overrides both) ------------------------------------------------------
    def _convert_linears(self) -> list[str]:
        """Swap the decoder linears the recipe puts in FP8 for ``FP8TrainLinear``; returns their names.

        Called once in ``__init__``, after the model is loaded and before the optimizer takes
        the parameters; a swap must keep the parameters' HF names.
        """
        if self.opts.precision != "fp8":
            return []
        names = fp8_linear_names(self.model, self.opts)
        spec = self.opts.spec
        swap_modules(self.model, names, lambda _n, old: FP8TrainLinear.from_linear(old, spec))  # type: ignore[arg-type]
        for m in self.model.modules():
            if isinstance(m, FP8TrainLinear):
                m.cache_until_changed = self.sharded
        return names

    def _logits(
        self, ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """The model's logits ``[n, L, V]`` for ``ids [n, L]`` under training numerics (grad as the caller's).

        ``attention_mask`` ``[n, L]`` (1: a token) or None for none padded, with ``position_ids`` None then
        (``_model_inputs``).  No KV cache: HF would otherwise build one (``config.use_cache``) that no training forward
        reads.  Where the trainer prepares the masks, the forward reads nothing back from the GPU
        (``fp8rl.train.model_inputs``)."""
        if not self._masks:
            return self.model(
                input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).logits
        mask = causal_padding_mask(attention_mask) if attention_mask is not None else None
        with no_mask_sdpa(self.model):
            return self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits

    def _model_inputs(self, b: SequenceBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(attention mask, position ids) of a host micro-batch for ``_logits``, on the device; both None where the
        trainer prepares the masks and no token is padded."""
        if self._masks and unpadded(b.attention_mask, b.position_ids):
            return None, None
        return to_device(b.attention_mask, self.device), to_device(b.position_ids, self.device)

    # ---- forward -------------------------------------------------------------------------------------
    def _response_logprobs(self, batch: SequenceBatch, temperature: float) -> torch.Tensor:
        """Per-token logprobs of the response tokens ``[n, T]`` under training numerics (with grad).

        The forward runs on the micro-batch's columns that are not padding in every row; the logprobs are
        zero-padded back to ``T``.  Counts the tokens computed and the valid ones (``tokens_computed``)."""
        full_t = batch.response_mask.shape[1]
        b = batch.trimmed()
        n, t = b.input_ids.shape[0], b.response_mask.shape[1]
        self._tokens[1] += float(b.attention_mask.sum())
        b = self.micro.bucketed(b)
        self._tokens[0] += float(b.input_ids.numel())
        ids = to_device(b.input_ids, self.device)
        with self.graphs.active() if self.graphs is not None else nullcontext():
            logits = self._logits(ids, *self._model_inputs(b))
        tb = ids.shape[1] - b.prompt_width
        pred = logits[:, b.prompt_width - 1 : b.prompt_width - 1 + tb, :]
        # chunked: no fp32 copy of the whole [n, t, vocab] logits (fp8rl.train.token_logprobs)
        lp = token_logprobs(pred, ids[:, b.prompt_width :], temperature)
        lp = (lp * to_device(b.response_mask, self.device))[:n, :t]
        return torch.nn.functional.pad(lp, (0, full_t - t)) if t < full_t else lp

    @torch.no_grad()
    def compute_logprobs(self, batch: SequenceBatch, temperature: float) -> torch.Tensor:
        t = batch.response_mask.shape[1]
        out = [torch.zeros(0, t, device=self.device)]
        for sl in self.micro.slices(batch):
            if sl.stop == 0:  # a sharded rank with fewer micro-batches: its part of the collectives only
                self._padding_pass(batch, temperature)
                continue
            out.append(self._response_logprobs(batch.slice(sl), temperature))
        if self.sharded:  # the root unit stays gathered after a forward with no backward: free it
            self.model.reshard()
        return torch.cat(out).cpu()  # read back once: a copy per micro-batch would drain the GPU's queue each time

    @torch.no_grad()
    def kv_scales(self, batch: SequenceBatch, quantile: float, margin: float) -> tuple[dict[int, KVScales], float]:
        """FP8 KV-cache scales of this policy over ``batch`` and the seconds they took.

        Sharded, every rank must call it with the same batch (the decoder layers gather their shards).
        """
        if self.sharded:
            # the calibration runs the decoder alone, past the root unit's pre-forward hook, so the root's
            # parameters (embeddings, final norm) are gathered here; before the first forward the FSDP state
            # is not initialised yet, and unshard() alone would gather nothing
            self.model._get_fsdp_state()._lazy_init()
            self.model.unshard()
        try:
            return timed_calibration(
                self.model, batch.input_ids, batch.attention_mask, batch.position_ids, quantile, margin
            )
        finally:
            if self.sharded:
                # the calibration's forward left FP8 copies of the whole model cached and the root (and, with
                # fp8_gather_once, the layers) gathered; it runs in the sync, before the colocated engine wakes: let
                # them go (_weights_changed reshards every held unit, the root among them) -- the next forward
                # quantizes and gathers again
                self._weights_changed()

    # ---- updates -------------------------------------------------------------------------------------
    @profiled_step  # under the profiler when asked (profile_next_policy_step)
    def policy_step(self, step: PolicyStep) -> dict[str, float]:
        """One optimizer step of the PPO-clip/GRPO loss over the whole batch, in micro-batches.

        The per-micro-batch losses are weighted so the result equals the loss aggregated over the full batch.  A
        data-parallel rank's ``step.totals`` are those of the batch all ranks share, so its weighted loss and metrics
        are its exact part of the global ones, and the optimizer's ``grad_reducer`` sums the gradients across ranks.
        With ``step.old`` a ``TrainForwardOld`` the old logprobs are this step's own forward's (no
        ``compute_logprobs`` before it): exact because the step consumes the whole batch
        (``fp8rl.train.old_logprobs``); the metrics then add ``mismatch/...`` and ``correction/...`` (this rank's
        share; ``correction/is_weight_sq_mean`` for ``ess_metric``)."""
        source = replace(step.old)  # what the update gathers starts empty, whatever ran before
        return self._policy_update(step.batch, step.advantages, source, step.loss_cfg, step.temperature,
                                   step.batch_totals())  # fmt: skip

    def _policy_update(
        self,
        batch: SequenceBatch,
        advantages: torch.Tensor,
        source: RecomputedOld | TrainForwardOld,
        loss_cfg: GRPOConfig,
        temperature: float,
        totals: tuple[float, float],
    ) -> dict[str, float]:
        """The micro-batches' forwards and backwards, then the optimizer step; ``source`` gives each micro-batch's
        old logprobs, IS weights, loss mask and weight (``fp8rl.train.old_logprobs``)."""
        # the metrics are summed on the device and read back once, after the optimizer step: reading a value per
        # micro-batch would make the host wait for that micro-batch's forward or backward, and the GPU then idles
        # while the host prepares and launches the next one (what FP8's shorter GEMMs expose)
        names: list[str] = []
        sums: torch.Tensor | None = None
        self._tokens = [0.0, 0.0]
        self.step_memory.start()
        for sl in self._update_slices(batch):
            if float(source.host_mask(sl).sum()) == 0:
                if self.sharded:  # the other ranks' all-gathers and reduce-scatters still need this one's
                    self._padding_pass(batch, temperature).sum().mul(0.0).backward()
                continue
            lp = self._response_logprobs(batch.slice(sl), temperature)
            mb = source.terms(sl, lp, loss_cfg.loss_agg, totals)
            inp = PolicyLossInput(
                logprobs=lp, old_logprobs=mb.old_logprobs, advantages=to_device(advantages[sl], self.device),
                mask=mb.loss_mask, is_weights=mb.is_weights,
            )  # fmt: skip
            loss, stats = policy_loss_stats(inp, loss_cfg)
            (loss * mb.weight).backward()
            self.optimizer.accumulate()
            row = stats_row(stats) * mb.weight
            sums, names = (row if sums is None else sums + row), list(stats)
            # this micro-batch's autograd graph goes now, not when the next forward rebinds the names: a CUDA
            # graph captured in that forward must not find the parameters' gradient nodes of this one alive
            del lp, inp, loss, stats, mb
        return self._finish_update(source, loss_cfg, totals, sums, names)

    def _finish_update(
        self,
        source: RecomputedOld | TrainForwardOld,
        loss_cfg: GRPOConfig,
        totals: tuple[float, float],
        sums: torch.Tensor | None,
        names: list[str],
    ) -> dict[str, float]:
        """The optimizer and scheduler step after the micro-batches, and the step's metrics (read back once)."""
        scale = source.finish(loss_cfg.loss_agg, totals, self._all_ranks_sum)
        grad_norm = self._optimizer_step(scale)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.step_count += 1
        computed, valid = self._tokens
        if sums is not None and scale != 1.0:
            sums = sums * scale
        metrics = dict(zip(names, sums.tolist(), strict=True)) if sums is not None else {"loss": 0.0}
        return {
            **metrics, **source.metrics(), "grad_norm": grad_norm, "lr": float(lr), "tokens_computed": computed,
            "tokens_valid": valid, **(self.graphs.stats() if self.graphs is not None else {}),
            **self.step_memory.metrics(),
        }  # fmt: skip

    def _all_ranks_sum(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the data-parallel ranks in place (nothing in one process)."""
        if self.sharded or self.optimizer.grad_reducer is not None:
            import torch.distributed as dist

            dist.all_reduce(t)

    def profile_next_policy_step(self) -> None:
        """The next ``policy_step`` runs under the profiler; its metrics add ``profile/train_ms/<category>``
        (``fp8rl.train.step_profile``)."""
        self.step_profile.arm()

    def sft_step(self, batch: SequenceBatch) -> dict[str, float]:
        """One optimizer step of token-mean cross entropy on the response (answer) tokens."""
        count = batch.response_mask.sum().to(torch.float64)
        if self.sharded:  # the mean is over every rank's tokens, as one process taking the whole batch
            import torch.distributed as dist

            count = count.to(self.device)
            dist.all_reduce(count)
        total = float(count.clamp(min=1))
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)  # read back once (as policy_step)
        for sl in self._update_slices(batch):
            lp = self._response_logprobs(batch.slice(sl), 1.0) if sl.stop else self._padding_pass(batch, 1.0)
            loss = -(lp.sum()) / total
            loss.backward()
            self.optimizer.accumulate()
            loss_total += loss.detach().double()
            del lp, loss  # as in policy_step
        grad_norm = self._optimizer_step()
        self.scheduler.step()
        self.step_count += 1
        return {"sft_loss": float(loss_total), "grad_norm": grad_norm}
