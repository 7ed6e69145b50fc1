"""Shared fixtures: tiny models written once per session, GPU availability."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# CI replays the same examples on every run (a failure there is reproducible, never a fluke of
# the draw); locally hypothesis keeps exploring new ones.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """bf16 checkpoints of every preset, plus a sharded 'small'."""
    from fp8rl.models import PRESETS, save_tiny_model

    root = tmp_path_factory.mktemp("models")
    paths = {name: save_tiny_model(root / name, name, seed=0) for name in PRESETS}
    paths["small-sharded"] = save_tiny_model(root / "small-sharded", "small", seed=0, max_shard_size="1MB")
    return paths


def cuda_fp8_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
