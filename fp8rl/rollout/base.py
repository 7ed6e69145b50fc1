"""The rollout interface: ``generate(prompts, sampling) -> Rollout`` and in-place weight loading."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from fp8rl.quant import QuantizedTensor


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy.  Logprobs are of the temperature-scaled distribution before
    top-k / top-p truncation (what the trainer recomputes); RL runs keep top_p = 1, top_k = 0."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 8
    seed: int = 0
    ignore_eos: bool = False  # benchmarks: every response runs to max_tokens


@dataclass
class Rollout:
    """Responses to N prompts, right-padded to T tokens.

    ``response_ids [N, T]`` (int64), ``response_mask [N, T]`` (1 for generated tokens,
    including the EOS that ended a response), ``logprobs [N, T]`` float32: the log
    probability of each sampled token under the engine's own forward (ROLLOUT numerics),
    0 where masked.  ``prompt_ids`` are the unpadded prompts; ``policy_version`` is the
    version of the weights that generated this rollout.  Tensors are on the CPU.
    """

    prompt_ids: list[list[int]]
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    finished: torch.Tensor
    policy_version: int

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())


class RolloutGenerator(Protocol):
    """What the loop and the evaluation need: generation, and the version and pad id it serves."""

    policy_version: int
    pad_token_id: int

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> Rollout: ...


class RolloutEngine(RolloutGenerator, Protocol):
    """A rollout engine in this process: generation plus in-place weight loading."""

    def load_weights(self, weights: Mapping[str, torch.Tensor | QuantizedTensor], version: int) -> None:
        """Overwrite weights in place (HF names); FP8 entries come as QuantizedTensor."""
        ...

    def held_weights(self) -> dict[str, torch.Tensor | QuantizedTensor]:
        """What the engine holds now, for the bit-exact sync check."""
        ...


class LocalEngine(RolloutEngine, Protocol):
    """A rollout engine the loop builds (``fp8rl.build.build_engine``): the torch engine or vLLM.

    ``fp8_modules`` names the decoder linears it holds in FP8 (HF module names, the sync
    requantizes exactly those); ``sleep``/``wake_up`` free and restore its device memory
    for a trainer sharing the device.
    """

    fp8_modules: list[str]
    eos_token_id: int
    asleep: bool
    device: torch.device

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def weight_bytes(self) -> int: ...

    def calibrate_kv(
        self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> dict[str, float]:
        """Set FP8 KV-cache scales from ``model``'s activations on the batch; ``kv/...`` metrics, or
        ``{}`` for an engine whose KV cache is not FP8."""
        ...
