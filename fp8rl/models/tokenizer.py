"""A character-level tokenizer for the synthetic tasks, saved as a standard ``tokenizer.json``.

One token per printable ASCII character plus newline, and four special tokens.
It is a ``tokenizers`` BPE model with no merges (so every character is a token)
and a ``Fuse`` decoder (so decoding concatenates), which ``AutoTokenizer`` and
vLLM load like any fast tokenizer.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
CHAR_VOCAB: tuple[str, ...] = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")


def _char_vocab() -> dict[str, int]:
    return {tok: i for i, tok in enumerate([*SPECIAL_TOKENS.values(), *CHAR_VOCAB])}


def is_char_tokenizer(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer`` is this character tokenizer (as made here or loaded back), not a real model's."""
    return tokenizer.get_vocab() == _char_vocab()


def make_char_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer: ids 0-3 are special (pad, bos, eos, unk), then characters."""
    specials = list(SPECIAL_TOKENS.values())
    vocab = _char_vocab()
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)
