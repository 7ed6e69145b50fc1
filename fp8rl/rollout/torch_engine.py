"""The built-in rollout engine: an HF causal LM with FP8 linears, batched sampling with a KV cache.

It is the embedded default and the CPU test path; vLLM is the production engine.  In the
``fp8`` precision the decoder linears hold FP8 weights + scales (``FP8InferenceLinear``)
and quantize activations per the recipe; everything else runs in bf16.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from transformers import DynamicCache, PreTrainedModel

from fp8rl.models.layers import fp8_module_names, swap_modules
from fp8rl.models.loading import load_causal_lm
from fp8rl.models.special_tokens import model_special_tokens, special_tokens
from fp8rl.quant import QuantizedTensor, QuantSpec
from fp8rl.rollout.base import Rollout, SamplingParams
from fp8rl.rollout.fp8_linear import FP8InferenceLinear


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf.  ``logits [B, V]``."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


class TorchRolloutEngine:
    """``precision`` is ``bf16`` or ``fp8``; ``spec`` and the BF16 layer counts apply to ``fp8``."""

    def __init__(
        self,
        model: str | os.PathLike[str] | PreTrainedModel,
        precision: str = "bf16",
        spec: QuantSpec | None = None,
        bf16_first_layers: int = 0,
        bf16_last_layers: int = 0,
        device: str | torch.device = "cpu",
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        if precision not in ("bf16", "fp8"):
            raise ValueError(f"precision must be 'bf16' or 'fp8', got {precision!r}")
        if isinstance(model, PreTrainedModel):
            self.model = model.to(device=device, dtype=torch.bfloat16)  # type: ignore[call-arg]
        else:
            self.model = load_causal_lm(model, dtype=torch.bfloat16, device=device)
        self.model.eval().requires_grad_(False)
        self.device = torch.device(device)
        self.precision = precision
        self.spec = spec or QuantSpec()
        self.fp8_modules: list[str] = []
        if precision == "fp8":
            self.fp8_modules = fp8_module_names(self.model, bf16_first_layers, bf16_last_layers)
            swap_modules(self.model, self.fp8_modules, lambda _n, old: FP8InferenceLinear.from_linear(old, self.spec))  # type: ignore[arg-type]
        # stop and pad ids from the config, generation config and tokenizer (fp8rl.models.special_tokens)
        if eos_token_id is None or pad_token_id is None:
            tokens = model_special_tokens(self.model) if isinstance(model, PreTrainedModel) else special_tokens(model)
            stop, pad = list(tokens.stop_ids), tokens.pad_id
        self.stop_token_ids = [int(eos_token_id)] if eos_token_id is not None else stop
        self.eos_token_id = self.stop_token_ids[0]
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else pad)
        self.policy_version = 0
        self.asleep = False

    # ---- colocation ----------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Give the device memory to a trainer sharing it: weights go to host memory until ``wake_up``.

        The KV cache lives only inside ``generate``, so the weights are all there is to free.
        On a CPU engine there is no device memory to give back; the state still changes, so
        a generate call on a sleeping engine fails the same way everywhere.
        """
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.asleep = True

    def wake_up(self) -> None:
        if self.device.type != "cpu":
            self.model.to(self.device)
        self.asleep = False

    # ---- weights -------------------------------------------------------------------------------------
    def held_weights(self) -> dict[str, torch.Tensor | QuantizedTensor]:
        out: dict[str, torch.Tensor | QuantizedTensor] = {}
        fp8 = set(self.fp8_modules)
        for name, module in self.model.named_modules():
            if name in fp8:
                assert isinstance(module, FP8InferenceLinear)
                out[name + ".weight"] = module.quantized_weight()
                if module.bias is not None:
                    out[name + ".bias"] = module.bias
        for name, p in self.model.named_parameters():
            out[name] = p.data
        return out

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor | QuantizedTensor], version: int) -> None:
        """Copy ``weights`` (HF names) into the engine's existing tensors; no new allocations."""
        params = dict(self.model.named_parameters())
        fp8 = {name + ".weight": name for name in self.fp8_modules}
        for name, value in weights.items():
            if name in fp8:
                module = self.model.get_submodule(fp8[name])
                assert isinstance(module, FP8InferenceLinear)
                if isinstance(value, QuantizedTensor):
                    module.load_(q=value)
                else:
                    module.load_(weight=value)
            elif name in params:
                if isinstance(value, QuantizedTensor):
                    raise ValueError(f"{name} is held in bf16 by the engine but an FP8 tensor was sent")
                params[name].copy_(value)
            else:
                raise KeyError(f"rollout engine has no weight named {name!r}")
        self.policy_version = version

    # ---- generation ----------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> Rollout:
        width = self._check_request(prompt_ids, sampling)
        n = len(prompt_ids)
        gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        ids, attn = self._left_padded(prompt_ids, width)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids, attention_mask=attn, position_ids=positions, past_key_values=cache, use_cache=True
        )
        logits = out.logits[:, -1, :]
        next_pos = positions[:, -1] + 1

        tokens, lps, alive = [], [], []
        finished = torch.zeros(n, dtype=torch.bool, device=self.device)
        stop = torch.tensor([] if sampling.ignore_eos else self.stop_token_ids, dtype=torch.long, device=self.device)
        for _ in range(sampling.max_tokens):
            token, lp = self._sample(logits.float(), sampling, gen)
            alive.append(~finished)
            token = torch.where(finished, torch.full_like(token, self.pad_token_id), token)
            tokens.append(token)
            lps.append(torch.where(finished, torch.zeros_like(lp), lp))
            finished = finished | torch.isin(token, stop)
            if bool(finished.all()):
                break
            attn = torch.cat([attn, torch.ones((n, 1), dtype=attn.dtype, device=self.device)], dim=1)
            out = self.model(
                input_ids=token[:, None],
                attention_mask=attn,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1
        mask = torch.stack(alive, dim=1).to(torch.float32)
        # a Rollout is host data (it crosses to the trainer, possibly another process)
        return Rollout(
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids=torch.stack(tokens, dim=1).cpu(),
            response_mask=mask.cpu(),
            logprobs=(torch.stack(lps, dim=1).to(torch.float32) * mask).cpu(),
            finished=finished.cpu(),
            policy_version=self.policy_version,
        )

    def _check_request(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> int:
        """The longest prompt's length, once the engine is awake and the prompts and responses fit the model."""
        if self.asleep:
            raise RuntimeError("the rollout engine is asleep (colocated with training); wake_up() first")
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("generate needs at least one non-empty prompt")
        width = max(len(p) for p in prompt_ids)
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and width + sampling.max_tokens > limit:
            raise ValueError(
                f"sampling.max_tokens {sampling.max_tokens} + the longest prompt ({width} tokens) exceed the model's "
                f"max_position_embeddings {limit}"
            )
        return width

    def _left_padded(self, prompt_ids: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts left-padded to ``width``: token ids and attention mask, [N, width] each."""
        ids = torch.full((len(prompt_ids), width), self.pad_token_id, dtype=torch.long, device=self.device)
        attn = torch.zeros((len(prompt_ids), width), dtype=torch.long, device=self.device)
        for i, p in enumerate(prompt_ids):
            ids[i, width - len(p) :] = torch.tensor(p, device=self.device)
            attn[i, width - len(p) :] = 1
        return ids, attn

    @staticmethod
    def _sample(logits: torch.Tensor, s: SamplingParams, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if s.temperature == 0:
            logprobs = logits.log_softmax(-1)
            token = logits.argmax(-1)
        else:
            scaled = logits / s.temperature
            logprobs = scaled.log_softmax(-1)
            probs = filter_logits(scaled, s.top_k, s.top_p).softmax(-1)
            token = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        return token, logprobs.gather(-1, token[:, None]).squeeze(-1)

    def calibrate_kv(
        self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> dict[str, float]:
        """The KV cache here is bf16: nothing to calibrate (``kv_cache: fp8`` needs the vLLM engine)."""
        return {}

    def weight_bytes(self) -> int:
        """Bytes of the weights the engine holds (FP8 linears count 1 byte per element plus scales)."""
        total = 0
        for module in self.model.modules():
            for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                total += t.numel() * t.element_size()
        return total
