"""The torch training backend: BF16 or FP8 linears, fp32 master weights, micro-batched policy updates.

Logprobs are recomputed here under TRAINING numerics; for ``fp8`` the decoder linears run
forward, dgrad and wgrad in FP8 (``FP8TrainLinear``) with the recipe's scaling, while
embeddings, lm_head, norms, attention math and the configured BF16 layers stay BF16.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fp8rl.atomic import atomic_directory
from fp8rl.models.layers import fp8_module_names, swap_modules
from fp8rl.models.loading import load_causal_lm
from fp8rl.models.tiny import pin_tokenizer_class
from fp8rl.models.tokenizer import is_char_tokenizer
from fp8rl.quant import QuantSpec
from fp8rl.rl import PolicyLossConfig, PolicyLossInput, policy_loss
from fp8rl.train.fp8_linear import FP8TrainLinear
from fp8rl.train.optim import MasterWeightAdamW, lr_lambda


@dataclass(frozen=True)
class TrainerOptions:
    precision: str = "bf16"  # bf16 | fp8
    spec: QuantSpec = field(default_factory=QuantSpec)
    backend: str = "torch"  # torch | te (fp8rl.train.te_trainer)
    te_recipe: str = "auto"  # te: auto | delayed (fp8rl.config.Recipe.te_recipe)
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    lr: float = 2e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"
    total_steps: int = 100
    micro_batch_size: int = 64


@dataclass
class SequenceBatch:
    """Prompts (left-padded) followed by responses: ``input_ids [N, P+T]``, ``attention_mask [N, P+T]``,
    ``position_ids [N, P+T]``; the response tokens are ``input_ids[:, P:]`` with ``response_mask [N, T]``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    prompt_width: int

    def slice(self, s: slice) -> SequenceBatch:
        return SequenceBatch(
            self.input_ids[s], self.attention_mask[s], self.position_ids[s], self.response_mask[s], self.prompt_width
        )


def build_batch(
    prompt_ids: list[list[int]], response_ids: torch.Tensor, response_mask: torch.Tensor, pad_id: int
) -> SequenceBatch:
    n, t = response_ids.shape
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((n, width + t), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width + t), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p) : width] = torch.tensor(p)
        attn[i, width - len(p) : width] = 1
    ids[:, width:] = response_ids.cpu()
    attn[:, width:] = response_mask.cpu().long()
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    return SequenceBatch(ids, attn, positions, response_mask.cpu().float(), width)


def policy_batch_totals(loss_mask: torch.Tensor) -> tuple[float, float]:
    """(valid tokens, valid sequences) of a policy batch: the denominators of its loss aggregation."""
    return float(loss_mask.sum().clamp(min=1)), float((loss_mask.sum(-1) > 0).sum().clamp(min=1))


class TorchTrainer:
    def __init__(self, model: str | os.PathLike[str] | PreTrainedModel, opts: TrainerOptions, device: str = "cpu"):
        if opts.precision not in ("bf16", "fp8"):
            raise ValueError(f"trainer precision must be 'bf16' or 'fp8', got {opts.precision!r}")
        if isinstance(model, PreTrainedModel):
            self.model = model.to(device=device, dtype=torch.bfloat16)  # type: ignore[call-arg]
        else:
            self.model = load_causal_lm(model, dtype=torch.bfloat16, device=device)
        self.model.train()
        self.device = torch.device(device)
        self.opts = opts
        self.fp8_modules: list[str] = self._convert_linears()
        self.optimizer = MasterWeightAdamW(
            list(self.model.parameters()), lr=opts.lr, betas=opts.betas, weight_decay=opts.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer.optimizer, lr_lambda(opts.warmup_steps, opts.total_steps, opts.schedule)
        )
        self.pad_token_id = int(self.model.config.pad_token_id or 0)
        self.step_count = 0

    # ---- backend hooks (TETrainer overrides both) ------------------------------------------------------
    def _convert_linears(self) -> list[str]:
        """Swap the decoder linears the recipe puts in FP8 for ``FP8TrainLinear``; returns their names.

        Called once in ``__init__``, after the model is loaded and before the optimizer takes
        the parameters; a swap must keep the parameters' HF names.
        """
        if self.opts.precision != "fp8":
            return []
        names = fp8_module_names(self.model, self.opts.bf16_first_layers, self.opts.bf16_last_layers)
        spec = self.opts.spec
        swap_modules(self.model, names, lambda _n, old: FP8TrainLinear.from_linear(old, spec))  # type: ignore[arg-type]
        return names

    def _logits(self, ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The model's logits ``[n, L, V]`` for ``ids [n, L]`` under training numerics (grad as the caller's)."""
        return self.model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids).logits

    # ---- forward -------------------------------------------------------------------------------------
    def _response_logprobs(self, b: SequenceBatch, temperature: float) -> torch.Tensor:
        """Per-token logprobs of the response tokens ``[n, T]`` under training numerics (with grad)."""
        ids = b.input_ids.to(self.device)
        logits = self._logits(ids, b.attention_mask.to(self.device), b.position_ids.to(self.device))
        t = ids.shape[1] - b.prompt_width
        pred = logits[:, b.prompt_width - 1 : b.prompt_width - 1 + t, :].float()
        if temperature > 0:
            pred = pred / temperature
        lp = pred.log_softmax(-1).gather(-1, ids[:, b.prompt_width :, None]).squeeze(-1)
        return lp * b.response_mask.to(self.device)

    @torch.no_grad()
    def compute_logprobs(self, batch: SequenceBatch, temperature: float) -> torch.Tensor:
        out = []
        for s in range(0, batch.input_ids.shape[0], self.opts.micro_batch_size):
            out.append(self._response_logprobs(batch.slice(slice(s, s + self.opts.micro_batch_size)), temperature))
        return torch.cat(out).cpu()

    # ---- updates -------------------------------------------------------------------------------------
    def policy_step(
        self,
        batch: SequenceBatch,
        advantages: torch.Tensor,
        old_logprobs: torch.Tensor,
        is_weights: torch.Tensor | None,
        loss_mask: torch.Tensor,
        loss_cfg: PolicyLossConfig,
        temperature: float,
        totals: tuple[float, float] | None = None,
    ) -> dict[str, float]:
        """One optimizer step of the PPO-clip/GRPO loss over the whole batch, in micro-batches.

        ``advantages [N]``, ``old_logprobs``/``is_weights``/``loss_mask [N, T]``.  The per-micro-batch
        losses are weighted so the result equals the loss aggregated over the full batch.  A
        data-parallel rank passes the global ``totals`` (valid tokens, valid sequences) of the
        batch all ranks share, so its weighted loss and metrics are its exact part of the global
        ones, and the optimizer's ``grad_reducer`` sums the gradients across ranks.
        """
        n = batch.input_ids.shape[0]
        if totals is None:
            totals = policy_batch_totals(loss_mask)
        total_tokens, total_seqs = totals
        sums: dict[str, float] = {}
        loss_total = 0.0
        for s in range(0, n, self.opts.micro_batch_size):
            sl = slice(s, s + self.opts.micro_batch_size)
            mb_mask = loss_mask[sl]
            if float(mb_mask.sum()) == 0:
                continue
            lp = self._response_logprobs(batch.slice(sl), temperature)
            inp = PolicyLossInput(
                logprobs=lp,
                old_logprobs=old_logprobs[sl].to(self.device),
                advantages=advantages[sl].to(self.device),
                mask=mb_mask.to(self.device),
                is_weights=None if is_weights is None else is_weights[sl].to(self.device),
            )
            loss, metrics = policy_loss(inp, loss_cfg)
            if loss_cfg.loss_agg == "token-mean":
                weight = float(mb_mask.sum()) / total_tokens
            else:
                weight = float((mb_mask.sum(-1) > 0).sum()) / total_seqs
            (loss * weight).backward()
            self.optimizer.accumulate()
            loss_total += float(loss.detach()) * weight
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v * weight
        grad_norm = self.optimizer.step(self.opts.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.step_count += 1
        return {**sums, "loss": loss_total, "grad_norm": grad_norm, "lr": float(lr)}

    def sft_step(self, batch: SequenceBatch) -> dict[str, float]:
        """One optimizer step of token-mean cross entropy on the response (answer) tokens."""
        n = batch.input_ids.shape[0]
        total = float(batch.response_mask.sum().clamp(min=1))
        loss_total = 0.0
        for s in range(0, n, self.opts.micro_batch_size):
            mb = batch.slice(slice(s, s + self.opts.micro_batch_size))
            lp = self._response_logprobs(mb, temperature=1.0)
            loss = -(lp.sum()) / total
            loss.backward()
            self.optimizer.accumulate()
            loss_total += float(loss.detach())
        grad_norm = self.optimizer.step(self.opts.grad_clip)
        self.scheduler.step()
        self.step_count += 1
        return {"sft_loss": loss_total, "grad_norm": grad_norm}

    # ---- weights -------------------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's (bf16) weights under their HF names: what is synced and checkpointed."""
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: fp32 masters, AdamW state, schedule position, step count."""
        return {
            "masters": [m.detach().clone() for m in self.optimizer.master],
            "optimizer": self.optimizer.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step_count": self.step_count,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        masters = state["masters"]
        if len(masters) != len(self.optimizer.master):
            raise ValueError(f"trainer state has {len(masters)} master tensors, the model {len(self.optimizer.master)}")
        for m, p, saved in zip(self.optimizer.master, self.optimizer.params, masters, strict=True):
            m.copy_(saved)
            p.copy_(saved)
        self.optimizer.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = int(state["step_count"])

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save an HF checkpoint (bf16); FP8 linears are plain ``nn.Linear`` subclasses with the same names."""
        self.model.save_pretrained(path)

    def save_checkpoint(
        self, dst: str | os.PathLike[str], tokenizer: PreTrainedTokenizerBase, overwrite: bool = True
    ) -> None:
        """The policy and its tokenizer as one loadable HF directory, written atomically."""
        with atomic_directory(dst, overwrite=overwrite) as tmp:
            self.save(tmp)
            tokenizer.save_pretrained(tmp)
            if is_char_tokenizer(tokenizer):  # a real model's tokenizer config is saved as it is
                pin_tokenizer_class(tmp)
