"""Named model shapes with random weights: what ``fp8rl bench step --shape`` and the benchmark presets measure at.

Speed does not depend on the weights' values, so a shape is enough to time a step: the Llama family's published
widths with random bf16 weights and the character tokenizer (``make_shape_model``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fp8rl.atomic import atomic_directory
from fp8rl.errors import UserError


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int = 8192


# Llama-family shapes (published configs' widths); random weights
SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(128, 384, 2, 2, 2, 128, 4096),
    "small": ModelShape(256, 768, 4, 4, 2, 128, 4096),
    "llama-1b": ModelShape(2048, 8192, 16, 32, 8, 128256),  # Llama-3.2-1B
    "llama-3b": ModelShape(3072, 8192, 28, 24, 8, 128256),  # Llama-3.2-3B
    "llama-8b": ModelShape(4096, 14336, 32, 32, 8, 128256),  # Llama-3.1-8B
}


def make_shape_model(shape: str, dst: str | os.PathLike[str], device: str = "cpu", seed: int = 0) -> Path:
    """A bf16 Llama checkpoint of ``shape`` with random weights and the char tokenizer, at ``dst``.

    Reused when ``dst`` already holds that shape (an 8B model takes ~16 GB and a minute to write)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fp8rl.models.tiny import pin_tokenizer_class
    from fp8rl.models.tokenizer import make_char_tokenizer

    if shape not in SHAPES:
        raise UserError(f"--shape: unknown model shape {shape!r}; expected one of {sorted(SHAPES)}")
    s = SHAPES[shape]
    dst = Path(dst)
    marker = dst / "fp8rl_bench_shape.json"
    if marker.is_file() and json.loads(marker.read_text()) == {"shape": shape, "seed": seed}:
        return dst
    tok = make_char_tokenizer()
    config = LlamaConfig(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads, max_position_embeddings=s.max_position_embeddings,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        initializer_range=0.02, dtype="bfloat16",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    with atomic_directory(dst, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        pin_tokenizer_class(Path(tmp))
        (Path(tmp) / "fp8rl_bench_shape.json").write_text(json.dumps({"shape": shape, "seed": seed}))
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the recipes' engines need this memory back
    return dst
