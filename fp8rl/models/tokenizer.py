"""A character-level tokenizer for the synthetic tasks, saved as a standard ``tokenizer.json``.

One token per printable ASCII character plus newline, and four special tokens.
It is a ``tokenizers`` BPE model with no merges (so every character is a token)
and a ``Fuse`` decoder (so decoding concatenates), which ``AutoTokenizer`` and
vLLM load like any fast tokenizer.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
CHAR_VOCAB: tuple[str, ...] = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")


def make_char_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer: ids 0-3 are special (pad, bos, eos, unk), then characters."""
    specials = list(SPECIAL_TOKENS.values())
    vocab = {tok: i for i, tok in enumerate(specials + list(CHAR_VOCAB))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)
