"""Why the row-scaled FP8 trainer learned less than BF16 and the block-scaled one (docs/accuracy.md, SmolLM2 study).

One batch of the study's task (the BF16 policy's sampled responses at T = 1), the policy-gradient loss
``-sum(A_i * logprob) / tokens`` over micro-batches of the config's size, and each decoder linear's weight gradient
under fp32 (the reference), bf16 (the BF16 trainer's numerics) and the two FP8 trainers' ``FP8TrainLinear``:
- FP8 row (fp8-e2e-row): X and dY per token, W per output channel; wgrad's X^T and dY^T per channel over every token
  of the micro-batch;
- FP8 block (fp8-e2e): 1x128 groups for X, dY, X^T, dY^T (along tokens for the last two), 128x128 weight tiles.
``--advantages``: GRPO advantages of the task's reward, or standard-normal ones per sequence (at step 0 the reward
is so sparse that a batch can hold no group whose rewards differ).

Printed and written (``--out``: gradients.json, gradients.md; the sampled batch is kept there and reused): each
recipe's gradient cosine and relative error against fp32, over all decoder linears and per layer, and each GEMM
operand's relative error under each FP8 scaling (measured on the fp32 run's operands).

    .venv/bin/python experiments/gradient_fidelity.py work/smollm2 --config docs/configs/accuracy/smollm2.yaml \
        --prompts 12 --group 8 --advantages random --out work/gradients

CPU, the library's reference quantizers (byte for byte what the fused GPU kernels compute): about 10 minutes of
sampling and 5 of gradients on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from fp8rl.atomic import atomic_write_text
from fp8rl.build import prompt_format, reward_for, task_examples
from fp8rl.config import load_recipe, parse_run_config
from fp8rl.diagnose import sample_sequences
from fp8rl.models.layers import fp8_module_names, swap_modules
from fp8rl.models.loading import load_tokenizer
from fp8rl.quant import QuantSpec
from fp8rl.quant.quantize import dequantize, quantize_activation, quantize_weight
from fp8rl.rl.advantages import grpo_advantages
from fp8rl.rollout.torch_engine import TorchRolloutEngine
from fp8rl.train.batches import SequenceBatch
from fp8rl.train.fp8_linear import FP8TrainLinear
from fp8rl.train.token_logprobs import token_logprobs

SPECS = {"fp8-row": QuantSpec(granularity="row"), "fp8-block": QuantSpec(granularity="block")}


def loss_of(model: torch.nn.Module, batch: Any, adv: torch.Tensor, tokens: float) -> torch.Tensor:
    dev = next(model.parameters()).device
    ids = batch.input_ids.to(dev)
    logits = model(
        input_ids=ids, attention_mask=batch.attention_mask.to(dev), position_ids=batch.position_ids.to(dev)
    ).logits
    t = batch.input_ids.shape[1] - batch.prompt_width
    pred = logits[:, batch.prompt_width - 1 : batch.prompt_width - 1 + t, :].float()
    lp = token_logprobs(pred, ids[:, batch.prompt_width :])
    mask = batch.response_mask.float().to(lp.device)
    return -(adv[:, None].to(lp.device) * lp * mask).sum() / tokens


OPERANDS = ("X", "X^T", "dY", "dY^T", "W")  # laid out as the GEMM reads them: scales along the last dimension


class OperandErrors:
    """The relative error each FP8 trainer's scaling gives each GEMM operand, accumulated over linears and
    micro-batches (sum of squared errors over sum of squares), and the share of nonzero entries flushed to zero."""

    def __init__(self) -> None:
        self.sums: dict[tuple[str, str], list[float]] = {}

    def add(self, operand: str, x: torch.Tensor) -> None:
        x = x.detach().float().contiguous()
        for recipe, spec in SPECS.items():  # the trainers' own quantizers: weights in tiles, the rest in groups
            back = dequantize(quantize_weight(x, spec) if operand == "W" else quantize_activation(x, spec))
            nz = x != 0
            acc = self.sums.setdefault((recipe, operand), [0.0, 0.0, 0.0, 0.0])
            acc[0] += float((back - x).double().norm() ** 2)
            acc[1] += float(x.double().norm() ** 2)
            acc[2] += float((nz & (back == 0)).sum())
            acc[3] += float(nz.sum())

    def table(self) -> dict[str, dict[str, dict[str, float]]]:
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (recipe, operand), (err, ref, flushed, nonzero) in self.sums.items():
            out.setdefault(recipe, {})[operand] = {
                "relative_error": (err / max(ref, 1e-30)) ** 0.5,
                "flushed": flushed / max(nonzero, 1.0),
            }
        return out


def linear_grads(
    model: torch.nn.Module, names: list[str], batch: Any, adv: torch.Tensor, micro: int,
    operands: OperandErrors | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The weight gradients of ``names``, accumulated over micro-batches of ``micro`` sequences (as the trainer
    does: each FP8 wgrad scales X^T and dY^T over one micro-batch's tokens); with ``operands``, every linear's
    operands of every micro-batch are measured as each FP8 trainer would quantize them."""
    handles = []
    if operands is not None:

        def fwd(m: Any, inp: tuple[torch.Tensor, ...]) -> None:
            x = inp[0].reshape(-1, inp[0].shape[-1])
            operands.add("X", x)
            operands.add("X^T", x.t())

        def bwd(m: Any, _gi: Any, go: tuple[torch.Tensor, ...]) -> None:
            dy = go[0].reshape(-1, go[0].shape[-1])
            operands.add("dY", dy)
            operands.add("dY^T", dy.t())

        for name in names:
            mod = model.get_submodule(name)
            operands.add("W", mod.weight)
            handles += [mod.register_forward_pre_hook(fwd), mod.register_full_backward_hook(bwd)]
    model.zero_grad(set_to_none=True)
    tokens = float(batch.response_mask.sum())
    for s in range(0, batch.input_ids.shape[0], micro):
        loss_of(model, batch.slice(slice(s, s + micro)), adv[s : s + micro], tokens).backward()
    for h in handles:
        h.remove()
    return {n: model.get_submodule(n).weight.grad.detach().float().clone() for n in names}


def compare(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.double().flatten(), b.double().flatten()
        return float(a @ b / (a.norm() * b.norm()))

    a = torch.cat([grads[n].flatten() for n in ref]).double()
    b = torch.cat([ref[n].flatten() for n in ref]).double()
    per_layer: dict[int, list[float]] = {}
    for n in ref:
        per_layer.setdefault(int(n.split(".")[2]), []).append(cosine(grads[n], ref[n]))
    return {
        "cosine": cosine(a, b),
        "relative_error": float((a - b).norm() / b.norm()),
        "cosine_per_layer": [sum(v) / len(v) for _, v in sorted(per_layer.items())],
    }


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--config", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--advantages", choices=("reward", "random"), default="reward",
        help="GRPO advantages of the task's reward, or standard-normal ones per sequence (a policy gradient of the "
        "same form in which every sequence counts)",
    )  # fmt: skip
    return ap.parse_args()


def _sampled_batch(args: argparse.Namespace, engine: Any, tok: Any, cfg: Any, examples: list[Any]) -> SequenceBatch:
    """The BF16 policy's responses to ``examples``; kept as ``<out>/sampled.pt`` and reused by a later run."""
    cache = args.out / "sampled.pt" if args.out else None
    if cache is not None and cache.exists():
        return SequenceBatch(**torch.load(cache))
    batch = sample_sequences(engine, tok, examples, prompt_format(cfg), cfg.sampling.max_tokens, args.seed)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(dataclasses.asdict(batch), cache)
    return batch


def _table(results: dict[str, Any]) -> str:
    ops = OPERANDS
    lines = [
        "| trainer | gradient cosine vs fp32 | relative error | lowest layer's cosine | "
        + " | ".join(f"{o} error" for o in ops) + " |",
        "|---|---|---|---|" + "---|" * len(ops),
    ]  # fmt: skip
    for label in ("bf16", *SPECS):
        r, d = results[label], results["operands"].get(label)
        cells = " | ".join(f"{d[o]['relative_error']:.4f} ({d[o]['flushed']:.2%} flushed)" if d else "-" for o in ops)
        lines.append(
            f"| {label} | {r['cosine']:.4f} | {r['relative_error']:.4f} | {min(r['cosine_per_layer']):.4f} | {cells} |"
        )
    return "\n".join(lines)


def main() -> int:
    args = _args()
    torch.manual_seed(args.seed)
    raw = yaml.safe_load(Path(args.config).read_text())
    cfg = parse_run_config({**raw, "recipe": load_recipe("bf16").model_dump()}, args.config)
    train, _ = task_examples(cfg)
    examples = [e for e in train[: args.prompts] for _ in range(args.group)]
    t0 = time.time()
    engine = TorchRolloutEngine(args.model_dir, "bf16", device=args.device)
    tok = load_tokenizer(args.model_dir)
    batch = _sampled_batch(args, engine, tok, cfg, examples)
    responses = zip(batch.input_ids[:, batch.prompt_width :], batch.response_mask, strict=True)
    texts = tok.batch_decode([r[m.bool()].tolist() for r, m in responses], skip_special_tokens=True)
    rewards = torch.tensor(reward_for(cfg).score(texts, examples).rewards)
    adv = grpo_advantages(rewards, args.group)
    if args.advantages == "random":  # every sequence carries a gradient (the reward's are sparse at step 0)
        adv = torch.randn(len(examples), generator=torch.Generator().manual_seed(args.seed))
    tokens = int(batch.response_mask.sum())
    groups = int((adv.view(-1, args.group).abs().sum(1) > 0).sum())
    print(f"{len(examples)} samples, {tokens} response tokens, reward mean {float(rewards.mean()):.3f}, "
          f"groups with a gradient {groups}/{args.prompts} ({time.time() - t0:.0f} s)")  # fmt: skip
    base = engine.model.requires_grad_(True)  # the engine's copy is inference-only
    names, micro, operands = fp8_module_names(base), cfg.optim.micro_batch_size, OperandErrors()
    ref = linear_grads(copy.deepcopy(base).float(), names, batch, adv, micro, operands)
    results: dict[str, Any] = {"samples": len(examples), "tokens": tokens, "reward_mean": float(rewards.mean()),
                               "linears": len(names), "advantages": args.advantages}  # fmt: skip
    results["bf16"] = compare(linear_grads(copy.deepcopy(base).to(torch.bfloat16), names, batch, adv, micro), ref)
    for label, spec in SPECS.items():
        model = copy.deepcopy(base).to(torch.bfloat16)
        swap_modules(model, names, lambda _n, old, spec=spec: FP8TrainLinear.from_linear(old, spec))
        results[label] = compare(linear_grads(model, names, batch, adv, micro), ref)
    results["operands"] = operands.table()
    table = _table(results)
    print(table)
    if args.out:
        atomic_write_text(args.out / "gradients.json", json.dumps(results, indent=2) + "\n")
        atomic_write_text(args.out / "gradients.md", table + "\n")
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
