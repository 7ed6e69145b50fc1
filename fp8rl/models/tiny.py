"""Tiny Llama-architecture causal LMs built from a config, for tests and the embedded demo.

Presets keep head_dim at 64 (supported by every vLLM attention backend) and, except
``tiny-odd``, every linear output and input dimension -- including the k/v
projections, num_key_value_heads * head_dim -- a multiple of 128: vLLM's block-FP8
loader requires each part of a fused qkv / gate_up layer to hold whole 128-row
tiles.  ``tiny-odd`` has partial tiles on purpose (for fp8rl's own code paths).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from fp8rl.atomic import atomic_directory
from fp8rl.models.tokenizer import make_char_tokenizer


@dataclass(frozen=True)
class TinyPreset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int = 128  # the char tokenizer has 100 tokens; rounded up
    max_position_embeddings: int = 512


PRESETS_MAX_LEN = 512

PRESETS: dict[str, TinyPreset] = {
    "tiny": TinyPreset(128, 384, 2, 2, 2),
    "small": TinyPreset(256, 768, 4, 4, 2),
    "tiny-odd": TinyPreset(192, 320, 2, 3, 1),
}


def _config(preset: TinyPreset) -> LlamaConfig:
    tok = make_char_tokenizer()
    return LlamaConfig(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.02,
        attention_bias=False,
        mlp_bias=False,
    )


def make_tiny_model(
    preset: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A randomly initialised tiny model (deterministic in ``seed``) and the char tokenizer."""
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny-model preset {preset!r}; expected one of {sorted(PRESETS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(_config(PRESETS[preset]))
    model = model.to(dtype)  # type: ignore[arg-type]
    return model.eval(), make_char_tokenizer()


def pin_tokenizer_class(directory: Path) -> None:
    # transformers maps some model types to their own tokenizer classes; name the
    # generic fast tokenizer explicitly so every loader builds the char tokenizer.
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_max_length"] = PRESETS_MAX_LEN
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def save_tiny_model(
    dst: str | os.PathLike[str],
    preset: str = "tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a tiny model in Hugging Face format (config.json, safetensors, tokenizer files).

    ``max_shard_size`` (e.g. ``"200KB"``) writes a sharded checkpoint with an index.
    """
    model, tokenizer = make_tiny_model(preset, seed, dtype)
    with atomic_directory(dst, overwrite=overwrite) as tmp:
        if max_shard_size:
            model.save_pretrained(tmp, max_shard_size=max_shard_size)
        else:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        pin_tokenizer_class(Path(tmp))
    return Path(dst)
