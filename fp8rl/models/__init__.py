"""Models: the tiny-model factory (no downloads), loading of local Hugging Face causal LMs, and importing a
starting checkpoint from a source (preset, directory, ``hf://``).

The names below load their module on first use (PEP 562): a module that needs one part (the decoder-layer names of
``fp8rl.models.layers``, ``read_model_config``) does not import transformers through the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fp8rl.lazy import lazy_names

if TYPE_CHECKING:
    from fp8rl.models.loading import (
        SUPPORTED_MODEL_TYPES,
        UnsupportedModelError,
        load_causal_lm,
        load_tokenizer,
        read_model_config,
    )
    from fp8rl.models.sources import import_model
    from fp8rl.models.tiny import PRESETS, TinyPreset, make_tiny_model, save_tiny_model
    from fp8rl.models.tokenizer import CHAR_VOCAB, make_char_tokenizer

_HOME = {
    "SUPPORTED_MODEL_TYPES": "loading",
    "UnsupportedModelError": "loading",
    "load_causal_lm": "loading",
    "load_tokenizer": "loading",
    "read_model_config": "loading",
    "import_model": "sources",
    "PRESETS": "tiny",
    "TinyPreset": "tiny",
    "make_tiny_model": "tiny",
    "save_tiny_model": "tiny",
    "CHAR_VOCAB": "tokenizer",
    "make_char_tokenizer": "tokenizer",
}

__all__ = [
    "CHAR_VOCAB",
    "PRESETS",
    "SUPPORTED_MODEL_TYPES",
    "TinyPreset",
    "UnsupportedModelError",
    "import_model",
    "load_causal_lm",
    "load_tokenizer",
    "make_char_tokenizer",
    "make_tiny_model",
    "read_model_config",
    "save_tiny_model",
]


__getattr__ = lazy_names(__name__, _HOME)
