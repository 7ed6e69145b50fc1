"""Load local Hugging Face causal-LM directories (Qwen2, Qwen3, Llama and Gemma 3 text families)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fp8rl.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# model_type values whose decoder layers are named model.layers.N.{self_attn,mlp}.*_proj.  gemma3_text is Gemma 3's
# text-only causal LM (Gemma3ForCausalLM, e.g. Gemma-3-270M/1B); the multimodal gemma3 nests it under
# model.language_model and is not supported.  Gemma's differences stay inside transformers/vLLM and BF16: norms
# as (1 + w), the sqrt(hidden) embedding scale, q/k norms, GELU MLP, sliding-window layers.
SUPPORTED_MODEL_TYPES: frozenset[str] = frozenset({"qwen2", "qwen3", "llama", "gemma3_text"})


class UnsupportedModelError(UserError, ValueError):
    """The directory is not a local HF causal LM of a supported family."""


def read_model_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check ``config.json`` of a local checkpoint directory."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {root} does not exist")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise UnsupportedModelError(f"{cfg_path} is missing: not a Hugging Face checkpoint directory")
    try:
        cfg: dict[str, Any] = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"{cfg_path} is not valid JSON: {e}") from e
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{cfg_path}: model_type {model_type!r} is not supported; expected one of {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    return cfg


def load_causal_lm(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """Load a supported local causal LM (never downloads)."""
    from transformers import AutoModelForCausalLM  # here: 2-3 s to import, and read_model_config's users need none

    read_model_config(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model.to(device)  # type: ignore[arg-type]


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    read_model_config(path)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
