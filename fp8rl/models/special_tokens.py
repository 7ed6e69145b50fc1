"""Which token ids end a response and which pad a batch, from a checkpoint's three sources of truth.

Pretrained checkpoints disagree with themselves: ``config.json`` may name ``<|endoftext|>`` while
the chat template ends a turn with ``<|im_end|>`` (the tokenizer's ``eos_token``), Llama 3 lists
several ids in ``generation_config.json``, and many tokenizers have no pad token.  The rules,
the ones ``transformers.generate`` and vLLM follow:

- **stop ids**: the tokenizer's ``eos_token_id`` first (what a chat turn ends with), then every id
  of ``generation_config.json``'s ``eos_token_id`` (an int or a list), then ``config.json``'s;
  duplicates dropped.  The first is the *eos* (appended to SFT answers).
- **pad id**: the tokenizer's ``pad_token_id``, else ``config.json``'s / ``generation_config.json``'s,
  else the eos (padding is always masked, so sharing the id is safe).
- No eos anywhere, or an id outside the vocabulary, is a :class:`SpecialTokenError` naming the
  files that were read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8rl.errors import UserError


class SpecialTokenError(UserError, ValueError):
    """A checkpoint names no end-of-sequence token, or names an id outside its vocabulary."""


@dataclass(frozen=True)
class SpecialTokens:
    stop_ids: tuple[int, ...]
    pad_id: int

    @property
    def eos_id(self) -> int:
        return self.stop_ids[0]


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        return [int(v) for v in value if v is not None]
    raise TypeError(f"expected a token id or a list of ids, got {value!r}")


def resolve_special_tokens(
    config: dict[str, Any],
    generation_config: dict[str, Any] | None = None,
    tokenizer_eos: int | None = None,
    tokenizer_pad: int | None = None,
    source: str = "the checkpoint",
) -> SpecialTokens:
    """The module docstring's rules over already-read values; ``source`` names them in errors."""
    gen = generation_config or {}
    try:
        ordered = [*_ids(tokenizer_eos), *_ids(gen.get("eos_token_id")), *_ids(config.get("eos_token_id"))]
        pads = [*_ids(tokenizer_pad), *_ids(config.get("pad_token_id")), *_ids(gen.get("pad_token_id"))]
    except (TypeError, ValueError) as e:
        raise SpecialTokenError(f"{source}: eos_token_id / pad_token_id: {e}") from None
    stop = tuple(dict.fromkeys(ordered))
    if not stop:
        raise SpecialTokenError(
            f"{source}: no eos_token_id in the tokenizer, generation_config.json or config.json; a response would "
            "never end. Set eos_token_id in generation_config.json"
        )
    pad = pads[0] if pads else stop[0]
    vocab = config.get("vocab_size")
    if isinstance(vocab, int):
        bad = sorted({i for i in (*stop, pad) if not 0 <= i < vocab})
        if bad:
            raise SpecialTokenError(f"{source}: token ids {bad} are outside the vocabulary (vocab_size {vocab})")
    return SpecialTokens(stop, int(pad))


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecialTokenError(f"{path}: not valid JSON: {e}") from None
    return data if isinstance(data, dict) else None


def special_tokens(model_dir: str | os.PathLike[str], tokenizer: Any = None) -> SpecialTokens:
    """The stop and pad ids of the checkpoint at ``model_dir`` (its tokenizer is loaded when not given)."""
    root = Path(model_dir)
    config = _read_json(root / "config.json") or {}
    gen = _read_json(root / "generation_config.json")
    if tokenizer is None and ((root / "tokenizer.json").is_file() or (root / "tokenizer_config.json").is_file()):
        from fp8rl.models.loading import load_tokenizer

        tokenizer = load_tokenizer(root)
    tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    tok_pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    return resolve_special_tokens(config, gen, tok_eos, tok_pad, source=str(root))


def model_special_tokens(model: Any) -> SpecialTokens:
    """The same rules for an in-memory transformers model (its ``config`` and ``generation_config``)."""
    config = model.config.to_dict()
    gen_cfg = getattr(model, "generation_config", None)
    gen = gen_cfg.to_dict() if gen_cfg is not None else None
    return resolve_special_tokens(config, gen, source=type(model).__name__)
