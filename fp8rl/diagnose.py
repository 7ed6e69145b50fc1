"""Where FP8 disagreement comes from: per-layer attribution and the smallest BF16 layer set under a target.

The disagreement a recipe's FP8 rollout adds is measured against BF16 numerics on the same sequences:
the BF16 policy samples responses to the task's prompts, then the response tokens' teacher-forced
log-probabilities are computed with every decoder linear in BF16 (the reference) and with a chosen set
of decoder layers' linears in FP8 (the recipe's scaling; ``FP8InferenceLinear``, the built-in engine's
numerics, whose block-scaled decode logprobs equal its teacher-forced ones).  The number is
``token_mult_prob_error = mean_t exp(|lp_fp8 - lp_bf16|)`` (NeMo RL), 1.0 when identical.

1. per layer: only layer ``i`` in FP8 -> ``tmpe_i``; the excess ``tmpe_i - 1`` is that layer's share;
2. all layers in FP8 (what the recipe runs without BF16 layers);
3. recommendation: the smallest ``bf16_first_layers + bf16_last_layers`` (fewest BF16 layers first,
   then fewer at the end) whose FP8 model stays at or under ``target``; at most ``max_candidates``
   settings are evaluated (each one teacher-forced pass).

Everything runs on CPU or GPU with the library's own engine; vLLM and TransformerEngine kernels differ
in summation order, so their absolute numbers differ, the attribution by layer is what carries over.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fp8rl.atomic import atomic_directory
from fp8rl.models.layers import fp8_module_names, swap_modules
from fp8rl.models.loading import load_tokenizer
from fp8rl.quant import QuantSpec
from fp8rl.rl import mismatch_metrics
from fp8rl.rollout.base import SamplingParams
from fp8rl.rollout.fp8_linear import FP8InferenceLinear
from fp8rl.rollout.torch_engine import TorchRolloutEngine
from fp8rl.tasks import Example
from fp8rl.tasks.prompts import PromptFormat
from fp8rl.train.token_logprobs import token_logprobs
from fp8rl.train.trainer import SequenceBatch, build_batch


@dataclass
class Diagnosis:
    model: str
    spec: dict[str, Any]
    target: float
    sequences: int
    tokens: int
    tmpe_all_fp8: float
    per_layer: list[float]  # tmpe with only that layer in FP8
    candidates: list[dict[str, Any]] = field(default_factory=list)  # {first, last, tmpe}, in evaluation order
    recommendation: dict[str, Any] | None = None  # {first, last, tmpe}, or None if no candidate met the target

    def to_markdown(self) -> str:
        total_excess = sum(t - 1.0 for t in self.per_layer) or 1.0
        rows = [f"| {i} | {t:.5f} | {(t - 1.0) / total_excess:.1%} |" for i, t in enumerate(self.per_layer)]
        rec = self.recommendation
        verdict = (
            f"keep `bf16_first_layers: {rec['first']}`, `bf16_last_layers: {rec['last']}`: token_mult_prob_error "
            f"{rec['tmpe']:.5f} <= {self.target}"
            if rec
            else f"no setting of up to {len(self.candidates)} evaluated reaches {self.target}"
        )
        return (
            "\n".join(
                [
                    "# FP8 mismatch diagnosis",
                    "",
                    f"- model: `{self.model}`; recipe scaling: {self.spec}",
                    f"- {self.sequences} sampled sequences, {self.tokens} response tokens; reference: every linear in BF16",
                    f"- every decoder layer in FP8: token_mult_prob_error {self.tmpe_all_fp8:.5f}",
                    f"- recommendation: {verdict}",
                    "",
                    "| layer (only it in FP8) | token_mult_prob_error | share of the summed excess |",
                    "|---|---|---|",
                    *rows,
                    "",
                    "| bf16_first_layers | bf16_last_layers | token_mult_prob_error |",
                    "|---|---|---|",
                    *[f"| {c['first']} | {c['last']} | {c['tmpe']:.5f} |" for c in self.candidates],
                ]
            )
            + "\n"
        )


@contextmanager
def fp8_layers(model: PreTrainedModel, layers: set[int], spec: QuantSpec) -> Iterator[None]:
    """Temporarily run the decoder linears of ``layers`` in FP8 (the originals are put back afterwards)."""
    n = int(model.config.num_hidden_layers)
    if any(not 0 <= i < n for i in layers):
        raise ValueError(f"layers {sorted(layers)} outside the model's {n} decoder layers")
    names = [m for m in fp8_module_names(model) if int(m.split(".")[2]) in layers] if layers else []
    originals: dict[str, nn.Module] = {name: model.get_submodule(name) for name in names}
    swap_modules(model, names, lambda _n, old: FP8InferenceLinear.from_linear(old, spec))  # type: ignore[arg-type]
    try:
        yield
    finally:
        swap_modules(model, names, lambda name, _new: originals[name])


@torch.no_grad()
def response_logprobs(model: PreTrainedModel, batch: SequenceBatch, micro_batch: int = 32) -> torch.Tensor:
    """Teacher-forced log-probabilities of the response tokens ``[N, T]`` (temperature 1), masked."""
    device = next(model.parameters()).device
    out = []
    for s in range(0, batch.input_ids.shape[0], micro_batch):
        b = batch.slice(slice(s, s + micro_batch))
        ids = b.input_ids.to(device)
        logits = model(
            input_ids=ids, attention_mask=b.attention_mask.to(device), position_ids=b.position_ids.to(device)
        ).logits
        t = ids.shape[1] - b.prompt_width
        pred = logits[:, b.prompt_width - 1 : b.prompt_width - 1 + t, :]
        # chunked (fp8rl.train.token_logprobs): the same values as a whole-batch fp32 log_softmax, without its
        # [micro_batch, t, vocab] fp32 copies (~3 GB each for 32 x 96 tokens at Gemma 3's 262,144-token vocabulary)
        lp = token_logprobs(pred, ids[:, b.prompt_width :])
        out.append((lp * b.response_mask.to(device)).cpu())
    return torch.cat(out)


def sample_sequences(
    engine: TorchRolloutEngine, tok: PreTrainedTokenizerBase, examples: list[Example], fmt: PromptFormat,
    max_tokens: int, seed: int,
) -> SequenceBatch:  # fmt: skip
    """The BF16 policy's sampled responses (temperature 1) to ``examples``, as a teacher-forcing batch."""
    prompts = fmt.encode_all(tok, examples)
    rollout = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed))
    return build_batch(rollout.prompt_ids, rollout.response_ids, rollout.response_mask, engine.pad_token_id)


def candidate_settings(n_layers: int) -> Iterator[tuple[int, int]]:
    """(bf16_first, bf16_last) with the fewest BF16 layers first, then fewer at the end."""
    for kept in range(n_layers + 1):
        for last in range(kept + 1):
            yield kept - last, last


def diagnose(
    model_dir: str | Path,
    spec: QuantSpec,
    examples: list[Example],
    fmt: PromptFormat | None = None,
    target: float = 1.02,
    max_tokens: int = 16,
    max_candidates: int = 64,
    device: str = "cpu",
    seed: int = 0,
    log: Any = print,
) -> Diagnosis:
    """Per-layer FP8 disagreement of the model at ``model_dir`` and a BF16-layer recommendation (module docstring)."""
    engine = TorchRolloutEngine(model_dir, "bf16", device=device)
    tok = load_tokenizer(model_dir)
    batch = sample_sequences(engine, tok, examples, fmt or PromptFormat(), max_tokens, seed)
    model = engine.model
    mask = batch.response_mask
    ref = response_logprobs(model, batch)
    n = int(model.config.num_hidden_layers)

    def tmpe(layers: set[int]) -> float:
        with fp8_layers(model, layers, spec):
            lp = response_logprobs(model, batch)
        return float(mismatch_metrics(lp, ref, mask)["token_mult_prob_error"])

    per_layer = []
    for i in range(n):
        per_layer.append(tmpe({i}))
        log(f"diagnose: layer {i} alone in FP8: token_mult_prob_error {per_layer[-1]:.5f}")
    all_fp8 = tmpe(set(range(n)))
    log(f"diagnose: every layer in FP8: {all_fp8:.5f}")
    diag = Diagnosis(str(model_dir), asdict(spec), target, int(mask.shape[0]), int(mask.sum()), all_fp8, per_layer)
    for first, last in candidate_settings(n):
        if len(diag.candidates) >= max_candidates:
            break
        value = all_fp8 if first == last == 0 else tmpe(set(range(first, n - last)))
        diag.candidates.append({"first": first, "last": last, "tmpe": value})
        if value <= target:
            diag.recommendation = diag.candidates[-1]
            break
    return diag


def write_report(diag: Diagnosis, out_dir: str | Path, overwrite: bool = True) -> Path:
    """``diagnosis.md``, ``diagnosis.json`` and ``per_layer.png`` in ``out_dir`` (written whole, then renamed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        (tmp / "diagnosis.md").write_text(diag.to_markdown())
        (tmp / "diagnosis.json").write_text(json.dumps(asdict(diag), indent=2) + "\n")
        fig, ax = plt.subplots(figsize=(max(4, 0.4 * len(diag.per_layer) + 2), 3))
        ax.bar(range(len(diag.per_layer)), [t - 1.0 for t in diag.per_layer], color="tab:blue")
        ax.set_xlabel("decoder layer (only it in FP8)")
        ax.set_ylabel("token_mult_prob_error - 1")
        ax.set_title(f"all layers FP8: {diag.tmpe_all_fp8:.4f}; target {diag.target}")
        fig.tight_layout()
        fig.savefig(tmp / "per_layer.png", dpi=120)
        plt.close(fig)
    return Path(out_dir)


def diagnose_run(
    cfg: Any, model_dir: str | Path, out_dir: str | Path, target: float = 1.02, examples: int = 64,
    max_tokens: int | None = None, max_candidates: int = 64, device: str = "cpu", log: Any = print,
) -> Diagnosis:  # fmt: skip
    """``diagnose`` with a run config's rollout scaling (``rollout_quant_spec``: the recipe's, or per channel with
    ``rollout.fp8_scaling: channel``), task and prompt format; the report goes to ``out_dir``.

    The one entry the ``fp8rl diagnose`` command and the KFP component share.
    """
    from fp8rl.build import prompt_format, rollout_quant_spec, task_examples
    from fp8rl.errors import UserError

    if cfg.recipe.rollout_precision != "fp8":
        raise UserError(f"recipe {cfg.recipe.name!r}: its rollout is BF16, there is no FP8 disagreement to diagnose")
    if target < 1.0:
        raise UserError(f"target must be >= 1.0 (a token_mult_prob_error), got {target}")
    train, _ = task_examples(cfg)
    diag = diagnose(
        model_dir, rollout_quant_spec(cfg), train[:examples], prompt_format(cfg), target,
        max_tokens or cfg.sampling.max_tokens, max_candidates, device, cfg.seed, log,
    )  # fmt: skip
    write_report(diag, out_dir)
    return diag
