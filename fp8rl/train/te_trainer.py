"""The TransformerEngine training backend: the torch trainer with TE linears under ``te.autocast``.

What changes against ``TorchTrainer`` (everything else -- fp32 master weights and AdamW in
``MasterWeightAdamW``, micro-batching, losses, weight sync, checkpoints -- is inherited):

* The decoder's linear layers (``q/k/v/o_proj``, ``gate/up/down_proj``) become
  ``transformer_engine.pytorch.Linear`` holding a copy of the HF weight in BF16.  A TE
  linear's parameters are ``weight`` (and ``bias``), so every parameter keeps its HF name
  (``model.layers.N.self_attn.q_proj.weight``) and ``hf_state_dict``, the requantized
  weight sync, ``state_dict`` and checkpoints are unchanged; a checkpoint of one backend
  resumes in the other.  Embeddings, lm_head, norms, attention math and the recipe's
  BF16 layers (``bf16_first_layers`` / ``bf16_last_layers``) stay torch BF16.
* Every forward (with or without grad: ``compute_logprobs`` recomputes the old logprobs
  under the same FP8 numerics as the update) runs inside
  ``te.autocast(enabled=True, recipe=...)`` with the recipe ``fp8rl.train.te_recipes``
  translates; the backward runs outside it, as TE intends.  Precision ``bf16`` keeps the
  TE linears and runs them without autocast (te-BF16, the benchmark's baseline).
* TE's FP8 GEMMs need the token count (product of the leading dimensions) divisible by 8
  and ``in_features`` by 16: FP8 forwards pad each sequence on the right to a multiple of
  ``TOKEN_ALIGN`` with masked pad tokens.  Causal attention keeps the real tokens' logits
  independent of them; per-tensor scaling does see their activations in its amax, as it
  sees the prompts' left padding.

Why ``te.Linear`` and not the fused ``LayerNormLinear`` / ``LayerNormMLP``: the fused
modules own the RMSNorm weight and a fused qkv / gate_up weight, so the HF names (and the
rollout engine's per-projection FP8 tiles) would need a mapping both ways, and the norms
would move into TE's kernels; the fusion saves launches, which matter only on narrow
layers (docs/te.md, docs/benchmarks.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from fp8rl.models.layers import fp8_module_names, swap_modules
from fp8rl.quant import E4M3, QuantizedTensor
from fp8rl.train.te_recipes import TE_BLOCK, TERecipe, TERecipeError, require_te, te_recipe_for
from fp8rl.train.trainer import TorchTrainer, TrainerOptions, fp8_linear_names

TOKEN_ALIGN = 16  # pad FP8 forwards to a multiple of this many positions per sequence
QPARAM_ATTRS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
TE_EXTRA_STATE_SUFFIX = "._extra_state"


def apply_te_env(desc: TERecipe) -> None:
    """Set ``desc.env`` so TE's class defaults agree with the recipe when TE is imported after this.

    ``build_te_recipe`` sets the quantization parameters on the instance anyway, so a TE
    imported earlier (under another environment) still quantizes as the recipe says.
    """
    os.environ.update(desc.env)


def build_te_recipe(desc: TERecipe) -> Any:
    """The ``transformer_engine.common.recipe`` object ``desc`` describes, with its QParams set explicitly."""
    from transformer_engine.common import recipe as te_recipe

    kwargs = dict(desc.kwargs)
    kwargs["fp8_format"] = te_recipe.Format[kwargs["fp8_format"]]
    recipe = getattr(te_recipe, desc.cls)(**kwargs)
    if desc.pow2_scales is not None:
        # TE's quantizers read these class attributes, which TE fixed from the environment at import
        q = te_recipe.QParams(power_2_scale=desc.pow2_scales, amax_epsilon=0.0)
        for attr in QPARAM_ATTRS:
            setattr(recipe, attr, q)
    return recipe


def te_linear_from(te: Any, name: str, linear: nn.Linear) -> nn.Module:
    """A ``te.Linear`` holding a copy of ``linear``'s weight (and bias), in its dtype and on its device."""
    new = te.Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        params_dtype=linear.weight.dtype,
        device=linear.weight.device,
        init_method=lambda _w: None,  # the HF weight is copied in; no random init (and no RNG draw)
        name=name,
    )
    with torch.no_grad():
        new.weight.copy_(linear.weight)
        if linear.bias is not None:
            new.bias.copy_(linear.bias)
    return new


@contextmanager
def _entered(*contexts: AbstractContextManager[Any]) -> Iterator[None]:
    """One context manager entering ``contexts`` in order (and leaving them in reverse)."""
    with ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


class TETrainer(TorchTrainer):
    """``TorchTrainer`` with TransformerEngine linears; ``opts.backend`` is ``te`` (``fp8rl.build.build_trainer``).

    Fails at construction with a ``fp8rl.errors.UserError`` where TE, a CUDA device or the
    recipe's FP8 support is missing (``require_te``), or the recipe has no TE equivalent.
    """

    def __init__(
        self, model: str | os.PathLike[str] | PreTrainedModel, opts: TrainerOptions, device: str = "cuda"
    ) -> None:
        self.te_recipe_desc: TERecipe | None = (
            te_recipe_for(opts.spec, opts.te_recipe) if opts.precision == "fp8" else None
        )
        if self.te_recipe_desc is not None:
            apply_te_env(self.te_recipe_desc)
        self.te = require_te(str(device), self.te_recipe_desc)
        self.te_recipe = None if self.te_recipe_desc is None else build_te_recipe(self.te_recipe_desc)
        if opts.optim.activation_checkpointing and opts.te_recipe == "delayed":
            raise TERecipeError(
                "te_recipe 'delayed' (DelayedScaling) cannot be combined with activation checkpointing: its recompute "
                "would update the amax history a second time; use te_recipe 'auto' or turn checkpointing off"
            )
        self.te_modules: list[str] = []
        super().__init__(model, opts, device)

    # ---- backend hooks -------------------------------------------------------------------------------
    def _checkpoint_contexts(self) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        """Activation checkpointing recomputes a layer in the backward, outside the forward's ``te.autocast``: the
        recompute enters the same autocast, so TE's linears recompute in FP8 as the forward ran (TE's recipes here
        keep no state between forwards, but DelayedScaling, which ``__init__`` refuses with checkpointing)."""
        first, recompute = super()._checkpoint_contexts()
        if self.te_recipe is None:  # te-BF16: no autocast in the forward either
            return first, recompute
        return first, _entered(recompute, self.te.autocast(enabled=True, recipe=self.te_recipe))

    def _convert_linears(self) -> list[str]:
        """Swap decoder linears for ``te.Linear``: for ``fp8`` those outside the recipe's BF16 layers (returned:
        they run in FP8), for ``bf16`` all of them (te-BF16; returns none)."""
        fp8 = self.opts.precision == "fp8"
        names = fp8_linear_names(self.model, self.opts) if fp8 else fp8_module_names(self.model, 0, 0)
        if fp8:
            for name in names:
                lin = self.model.get_submodule(name)
                assert isinstance(lin, nn.Linear)
                if lin.in_features % 16 or lin.out_features % 8:
                    raise TERecipeError(
                        f"{name}: [{lin.out_features}, {lin.in_features}] -- TE's FP8 GEMMs need in_features "
                        "divisible by 16 and out_features by 8; use trainer 'torch' for this model"
                    )
        swap_modules(self.model, names, lambda n, old: te_linear_from(self.te, n, old))  # type: ignore[arg-type]
        self.te_modules = names
        return names if fp8 else []

    def _logits(
        self, ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> torch.Tensor:
        if self.te_recipe is None:
            return super()._logits(ids, attention_mask, position_ids)
        width = ids.shape[1]
        pad = -width % TOKEN_ALIGN
        if pad:
            if attention_mask is None or position_ids is None:  # no padding until these columns
                attention_mask = torch.ones_like(ids)
                position_ids = torch.arange(width, device=ids.device).expand_as(ids)
            ids = F.pad(ids, (0, pad), value=self.pad_token_id)
            attention_mask = F.pad(attention_mask, (0, pad), value=0)
            position_ids = F.pad(position_ids, (0, pad), value=0)
        with self.te.autocast(enabled=True, recipe=self.te_recipe):
            logits = super()._logits(ids, attention_mask, position_ids)
        return logits[:, :width]

    # ---- weights -------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """An HF checkpoint (bf16) under the HF names, without TE's per-module ``_extra_state`` (FP8 metadata).

        Sharded: the torch trainer's gathered save (parameters only, so no ``_extra_state`` either): the model's own
        state dict holds FSDP2's DTensor shards, which ``save_pretrained`` cannot write."""
        if self.sharded:
            super().save(path)
            return
        state = {k: v for k, v in self.model.state_dict().items() if not k.endswith(TE_EXTRA_STATE_SUFFIX)}
        self.model.save_pretrained(path, state_dict=state)


# ---- what TE quantizes, in fp8rl.quant's terms (the rollout-vs-training consistency check) -----------------
def te_block_quantizers(recipe: Any) -> dict[str, Any]:
    """The ``Float8BlockQuantizer`` s a TE module gets from a ``Float8BlockScaling`` ``recipe``, by role.

    Built through TE's own ``RecipeState`` (positional roles: forward ``input, weight``;
    backward ``grad_output``), so they carry the recipe's pow2 and block settings exactly as
    ``te.Linear`` receives them.
    """
    from transformer_engine.pytorch.quantization import RecipeState

    fwd = RecipeState.create(recipe, mode="forward", num_quantizers=3).make_quantizers()
    bwd = RecipeState.create(recipe, mode="backward", num_quantizers=2).make_quantizers()
    return {"input": fwd[0], "weight": fwd[1], "grad_output": bwd[0]}


@torch.no_grad()
def te_quantize_as_fp8rl(quantizer: Any, x: torch.Tensor) -> QuantizedTensor:
    """Quantize ``x [M, K]`` (CUDA) with a TE ``Float8BlockQuantizer``; the result in ``fp8rl.quant``'s layout.

    TE keeps rowwise FP8 bytes as uint8 ``[M, K]`` and FP32 ``scale_inv`` padded for the
    GEMM: 128x128 tiles as ``[ceil(M/128), roundup(ceil(K/128), 4)]``, 1x128 groups
    transposed as ``[ceil(K/128), roundup(M, 4)]``.  Returned: ``data`` float8_e4m3fn ``[M, K]``
    and ``scale_inv`` ``[ceil(M/128), ceil(K/128)]`` or ``[M, ceil(K/128)]``, as
    ``quantize_weight`` / ``quantize_activation`` give them.
    """
    if x.dim() != 2:
        raise ValueError(f"te_quantize_as_fp8rl takes a 2-D tensor, got shape {tuple(x.shape)}")
    m, k = x.shape
    rowwise = quantizer.copy()  # the columnwise (transposed) copy TE also makes for backward is not compared
    rowwise.set_usage(rowwise=True, columnwise=False)
    t = rowwise(x.contiguous())
    data = t._rowwise_data.view(torch.float8_e4m3fn).reshape(m, k)
    s = t._rowwise_scale_inv
    kb, mb = -(-k // TE_BLOCK), -(-m // TE_BLOCK)
    two_d = quantizer.block_scaling_dim == 2
    expected = (mb, -(-kb // 4) * 4) if two_d else (kb, -(-m // 4) * 4)
    if tuple(s.shape) != expected or tuple(data.shape) != (m, k):
        raise ValueError(
            f"TE block quantizer ({'128x128' if two_d else '1x128'}) of a [{m}, {k}] tensor gave data "
            f"{tuple(t._rowwise_data.shape)} and scale_inv {tuple(s.shape)}; the layout read from TE 2.20 "
            f"expects scale_inv {expected}"
        )
    if two_d:
        scale, block = s[:mb, :kb], (TE_BLOCK, TE_BLOCK)
    else:
        scale, block = s[:kb, :m].t(), (1, TE_BLOCK)
    return QuantizedTensor(data.contiguous(), scale.float().contiguous(), "block", E4M3, block)


def quantization_agreement(ours: QuantizedTensor, theirs: QuantizedTensor) -> dict[str, float]:
    """How far two quantizations of one tensor agree: FP8 bytes and scales, over the groups with amax > 0.

    ``bytes_exact_fraction``: share of elements with identical FP8 bytes (``max_fp8_steps_apart``: how
    many E4M3 steps the furthest pair is apart); ``scale_max_abs_diff`` /
    ``scale_max_rel_diff``: over groups whose scales are not those of an all-zero group (there TE
    stores 1, fp8rl 1e-10/448); ``zero_groups``: how many were left out.
    """
    if ours.data.shape != theirs.data.shape or ours.scale_inv.shape != theirs.scale_inv.shape:
        raise ValueError(
            f"shapes differ: data {tuple(ours.data.shape)} vs {tuple(theirs.data.shape)}, "
            f"scales {tuple(ours.scale_inv.shape)} vs {tuple(theirs.scale_inv.shape)}"
        )
    ua, ub = ours.data.view(torch.uint8).int(), theirs.data.view(torch.uint8).int()
    same = ua == ub
    # E4M3 codes of one sign are ordered by magnitude: the code distance counts FP8 steps
    ma, mb = ua & 0x7F, ub & 0x7F
    steps = torch.where(((ua ^ ub) & 0x80) == 0, (ma - mb).abs(), ma + mb)
    a, b = ours.scale_inv.double(), theirs.scale_inv.double()
    zero = fp8_group_abs_max(ours) == 0
    diff = (a - b).abs()[~zero]
    rel = diff / b[~zero]
    return {
        "bytes_exact_fraction": float(same.double().mean()),
        "bytes_mismatched": float((~same).sum()),
        "max_fp8_steps_apart": float(steps.max()) if steps.numel() else 0.0,
        "scale_max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
        "scale_max_rel_diff": float(rel.max()) if rel.numel() else 0.0,
        "scales_exact_fraction": float((a == b)[~zero].double().mean()) if diff.numel() else 1.0,
        "zero_groups": float(zero.sum()),
        "elements": float(same.numel()),
    }


def fp8_group_abs_max(q: QuantizedTensor) -> torch.Tensor:
    """The largest |FP8 value| of each scale group of ``q`` (0 marks an all-zero group), shaped as ``q.scale_inv``."""
    assert q.block is not None
    br, bc = q.block
    d = q.data.float().abs()
    m, k = d.shape
    d = F.pad(d, (0, -k % bc, 0, -m % br))
    return d.view(d.shape[0] // br, br, d.shape[1] // bc, bc).amax(dim=(1, 3)).reshape(q.scale_inv.shape)
