"""Materialize a starting checkpoint into a directory (the prepare-model step's work).

Sources, in the order they are recognised:

| source | what happens |
|---|---|
| a tiny preset (``tiny``, ``small``, ``tiny-odd``) | ``fp8rl.models.save_tiny_model(dst, preset, seed)``; no download |
| ``hf://<org>/<name>[@<revision>]`` | ``huggingface_hub.snapshot_download`` (safetensors, config, tokenizer files; ``$HF_TOKEN``) |
| ``file://<dir>`` or a directory path | copied (e.g. from a PVC mounted into the step) |

Every imported checkpoint must be a supported local HF causal LM (``fp8rl.models.loading.read_model_config``);
the copy is atomic, so a failed import leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from fp8rl.atomic import atomic_directory
from fp8rl.errors import UserError

HF_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]


def materialize_model(source: str, seed: int, dst: str | os.PathLike[str]) -> dict[str, Any]:
    """Write the checkpoint named by ``source`` to ``dst``; returns its origin (for the artifact's metadata)."""
    from fp8rl.models import PRESETS, save_tiny_model
    from fp8rl.models.loading import read_model_config

    if source in PRESETS:
        save_tiny_model(dst, source, seed=int(seed), overwrite=True)
        return {"source": f"tiny:{source}", "preset": source, "seed": int(seed)}
    uri = urlparse(source)
    with atomic_directory(dst, overwrite=True) as tmp:
        if uri.scheme == "hf":
            repo, _, revision = (uri.netloc + uri.path).partition("@")
            _download_hf(repo, revision or None, tmp)
        elif uri.scheme in ("", "file"):
            src = Path(uri.path if uri.scheme == "file" else source)
            if not src.is_dir():
                raise UserError(
                    f"model source {source!r}: not a tiny preset {sorted(PRESETS)} nor an existing checkpoint "
                    f"directory (for a volume, mount it into the step)"
                )
            shutil.copytree(src, tmp, dirs_exist_ok=True)
        else:
            raise UserError(
                f"model source {source!r}: unsupported scheme {uri.scheme!r}; expected a tiny preset "
                f"{sorted(PRESETS)}, a directory, file://<dir> or hf://<org>/<name>[@<revision>]"
            )
        read_model_config(tmp)  # a supported HF causal LM, or a UserError naming the file
    return {"source": source}


def _download_hf(repo: str, revision: str | None, dst: Path) -> None:
    from huggingface_hub import snapshot_download

    if repo.count("/") != 1:
        raise UserError(f"hf://{repo}: expected hf://<org>/<name>[@<revision>]")
    snapshot_download(
        repo, revision=revision, local_dir=dst, allow_patterns=HF_PATTERNS, token=os.environ.get("HF_TOKEN") or None
    )
