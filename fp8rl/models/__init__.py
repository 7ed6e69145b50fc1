"""Models: the tiny-model factory (no downloads), loading of local Hugging Face causal LMs, and importing a
starting checkpoint from a source (preset, directory, ``hf://``)."""

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
