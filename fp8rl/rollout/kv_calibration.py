"""FP8 KV-cache scales from the trainer's activations, recalibrated after every weight update.

vLLM stores K and V in float8_e4m3fn with one per-tensor scale per layer and, on
FlashAttention 3, also quantizes Q with its own scale (``x_fp8 = x / scale``, max 448).
The scales come from the trainer model (the policy the engine now serves) on a
calibration batch -- the step's prompts and responses -- as NeMo RL does:

    scale = quantile_p(|x|) * margin / 448        (p = rollout.kv_scale_quantile, e.g. 0.999)

K and Q reach the cache after RoPE, but forward hooks see them before it (HF applies RoPE
inside the attention forward, not in a module).  RoPE rotates the pairs (i, i + d/2) of a
head (HF ``rotate_half``), so every post-RoPE component is bounded by the norm of its
pair (and at most sqrt(2) above the pre-RoPE amax).  We therefore take the quantile over
the pair norms ``sqrt(x_i^2 + x_{i+d/2}^2)``: a bound whatever the position, including
positions longer than the batch's; the margin covers the drift of the activations until
the next recalibration (one optimizer step later).
V has no RoPE and uses |v| directly.  Models with q_norm/k_norm (Qwen3) are hooked after
the norm, which is what RoPE then rotates.  The quantile is taken per micro-batch and the
largest is kept (conservative, and no activations are held across micro-batches).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fp8rl.quant import E4M3

MIN_AMAX = 1e-6
_HOOKED = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.self_attn\.(?P<kind>q_proj|k_proj|v_proj|q_norm|k_norm)$")
_SAMPLE_LIMIT = 1 << 24  # torch.kthvalue on more elements than this is slow; sample evenly instead


@dataclass(frozen=True)
class KVScales:
    """One attention layer's FP8 scales (dequantization multipliers) and the amax they saw."""

    q: float
    k: float
    v: float
    k_amax: float = 0.0
    v_amax: float = 0.0


def scale_from_amax(amax: float, margin: float) -> float:
    """``max(amax, 1e-6) * margin / 448``: the e4m3 scale that maps ``amax * margin`` to the largest FP8 value."""
    return max(float(amax), MIN_AMAX) * margin / E4M3.max


def rope_pair_norms(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``x [..., H * head_dim]`` (or ``[..., H, head_dim]``) -> the norms of RoPE's pairs ``[..., H, head_dim / 2]``."""
    heads = x.reshape(*x.shape[:-1], -1, head_dim) if x.shape[-1] != head_dim else x
    half = head_dim // 2
    return torch.sqrt(heads[..., :half].float() ** 2 + heads[..., half:].float() ** 2)


def high_quantile(values: torch.Tensor, q: float) -> float:
    """The ``q`` quantile of ``values`` (k-th smallest, k = ceil(q * n)), on an even sample past 2^24 elements."""
    return float(quantile_on_device(values, q))


def quantile_on_device(values: torch.Tensor, q: float) -> torch.Tensor:
    """``high_quantile`` as a 0-d float32 tensor on the values' device: no host round trip per call."""
    flat = values.detach().float().flatten()
    if flat.numel() == 0:
        return torch.zeros((), device=flat.device)
    if flat.numel() > _SAMPLE_LIMIT:
        flat = flat[:: math.ceil(flat.numel() / _SAMPLE_LIMIT)]
    k = min(max(math.ceil(q * flat.numel()), 1), flat.numel())
    return _kth_smallest(flat, k)


def kth_smallest(flat: torch.Tensor, k: int) -> float:
    """The ``k``-th smallest of a 1-D tensor, where it lives.

    On a GPU: the smallest of the ``n - k + 1`` largest (``topk``; a high quantile keeps that few), the same
    order statistic without moving the values to the host -- a ``kthvalue`` on the CPU per hooked projection
    and micro-batch made an FP8 KV recalibration of a 1B model over 128 x 1k-token responses take ~90 s on
    Ray, where the actor has one CPU thread.  On the CPU: ``kthvalue``.
    """
    return float(_kth_smallest(flat, k))


def _kth_smallest(flat: torch.Tensor, k: int) -> torch.Tensor:
    n = flat.numel()
    if flat.is_cuda:
        return torch.topk(flat, n - k + 1, sorted=False).values.min()
    return torch.kthvalue(flat, k).values


class _Collector:
    """Forward hooks on every layer's q/k/v projections (or q/k norms) recording per-micro-batch quantiles."""

    def __init__(self, model: nn.Module, head_dim: int, quantile: float) -> None:
        self.head_dim, self.quantile = head_dim, quantile
        # the micro-batch's valid tokens as flat indices into [B * T] on the model's device: a boolean mask would
        # make every hook wait for the host to learn how many tokens it keeps
        self.valid: torch.Tensor | None = None
        # (layer, q|k|v) -> [quantile, amax], kept where the activations are and read once at the end: a host
        # round trip per hooked projection and micro-batch would stall the forward 2 x 3 x layers times
        self.stats: dict[tuple[int, str], torch.Tensor] = {}
        targets: dict[tuple[int, str], tuple[str, nn.Module]] = {}
        for name, module in model.named_modules():
            m = _HOOKED.search(name)
            if m is None:
                continue
            kind = m["kind"][0]  # q, k or v; a norm replaces its projection
            key = (int(m["layer"]), kind)
            if key not in targets or m["kind"].endswith("norm"):
                targets[key] = (m["kind"], module)
        if not targets:
            raise ValueError("no attention q/k/v projections (layers.N.self_attn.{q,k,v}_proj) found in the model")
        self.handles = [module.register_forward_hook(self._hook(key)) for key, (_, module) in targets.items()]

    def _hook(self, key: tuple[int, str]) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: object, output: torch.Tensor) -> None:
            assert self.valid is not None
            x = output.flatten(0, 1).index_select(0, self.valid.to(output.device))  # [tokens, ...] valid positions
            values = rope_pair_norms(x, self.head_dim) if key[1] in "qk" else x.float().abs()
            amax = values.max() if values.numel() else torch.zeros((), device=values.device)
            stat = torch.stack([quantile_on_device(values, self.quantile), amax.float()])
            old = self.stats.get(key)
            self.stats[key] = stat if old is None else torch.maximum(old, stat)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def calibrate_kv_scales(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    quantile: float = 0.999,
    margin: float = 1.1,
    max_tokens_per_forward: int = 16384,
) -> dict[int, KVScales]:
    """Per-layer FP8 scales for Q, K and V from a forward of ``model`` (an HF causal LM) over a batch.

    ``input_ids``, ``attention_mask``, ``position_ids``: ``[N, L]`` (a ``SequenceBatch``'s
    fields).  Only the decoder runs (no lm_head: logits of a large vocabulary would not fit).
    Returns ``{layer index: KVScales}``.
    """
    cfg: Any = getattr(model, "config")  # noqa: B009 -- an HF model's config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    get_decoder = getattr(model, "get_decoder", None)
    decoder: Any = get_decoder() if callable(get_decoder) else model
    device = next(model.parameters()).device
    collector = _Collector(model, head_dim, quantile)
    rows = max(1, max_tokens_per_forward // max(1, input_ids.shape[1]))
    try:
        for start in range(0, input_ids.shape[0], rows):
            s = slice(start, start + rows)
            mask = attention_mask[s].to(device)
            collector.valid = mask.flatten().nonzero().squeeze(1)  # once here, not once per hooked module
            decoder(
                input_ids=input_ids[s].to(device),
                attention_mask=mask,
                position_ids=position_ids[s].to(device),
                use_cache=False,
            )
    finally:
        collector.remove()
    return _scales(_read_stats(collector.stats, device), margin)


def _read_stats(stats: dict[tuple[int, str], torch.Tensor], device: torch.device) -> dict[tuple[int, str], list[float]]:
    """The collected (quantile, amax) pairs read back in one copy; non-finite ones (diverged weights) fail."""
    keys = list(stats)
    stacked = torch.stack([stats[k].to(device) for k in keys]) if keys else torch.zeros(0, 2)
    read = dict(zip(keys, stacked.tolist(), strict=True))
    bad = [f"layer {layer} {kind}" for (layer, kind), (quant, amax) in read.items() if not math.isfinite(amax + quant)]
    if bad:
        raise ValueError(
            f"FP8 KV calibration: non-finite activations in {', '.join(bad[:4])}: the policy's weights have diverged "
            "(NaN or inf); no scales can be set from them"
        )
    return read


def _scales(read: dict[tuple[int, str], list[float]], margin: float) -> dict[int, KVScales]:
    out = {}
    for layer in sorted({layer for layer, _ in read}):
        q, k, v = (read.get((layer, kind), [0.0, 0.0]) for kind in "qkv")
        out[layer] = KVScales(
            q=scale_from_amax(q[0], margin),
            k=scale_from_amax(k[0], margin),
            v=scale_from_amax(v[0], margin),
            k_amax=k[1],
            v_amax=v[1],
        )
    return out


def calibration_rows(attention_mask: torch.Tensor, max_tokens: int | None) -> slice:
    """Every k-th row of a batch ``[N, L]`` so the rows hold at most about ``max_tokens`` valid tokens (k the
    smallest that does; ``slice(None)``, the whole batch, when it fits or ``max_tokens`` is None).  Evenly spaced
    rows reach every prompt's group of samples before a second sample of any one."""
    if max_tokens is None:
        return slice(None)
    total = int(attention_mask.sum())
    return slice(None, None, max(1, math.ceil(total / max_tokens)))


def kv_scale_metrics(scales: dict[int, KVScales], seconds: float | None = None) -> dict[str, float]:
    """``kv/{q,k,v}_scale_{mean,min,max}`` and ``kv/{k,v}_clip_ratio_max``: the largest amax over the
    FP8 range (``amax / (448 * scale)``; above 1 means the quantile left outliers to be clipped)."""
    out: dict[str, float] = {}
    for kind in "qkv":
        vals = [getattr(s, kind) for s in scales.values()]
        if vals:
            out[f"kv/{kind}_scale_mean"] = sum(vals) / len(vals)
            out[f"kv/{kind}_scale_min"] = min(vals)
            out[f"kv/{kind}_scale_max"] = max(vals)
    for kind in "kv":
        ratios = [getattr(s, f"{kind}_amax") / (E4M3.max * getattr(s, kind)) for s in scales.values()]
        if ratios:
            out[f"kv/{kind}_clip_ratio_max"] = max(ratios)
    if seconds is not None:
        out["kv/calibration_s"] = seconds
    return out


def timed_calibration(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    quantile: float,
    margin: float,
) -> tuple[dict[int, KVScales], float]:
    """``calibrate_kv_scales`` and its wall time in seconds (the model is put in eval mode meanwhile)."""
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        scales = calibrate_kv_scales(model, input_ids, attention_mask, position_ids, quantile, margin)
    finally:
        model.train(was_training)
    return scales, time.perf_counter() - t0
