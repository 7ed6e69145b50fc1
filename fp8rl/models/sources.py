"""Model sources: write the starting checkpoint a source string names into a directory.

Sources, in the order they are recognised:

| source | what happens |
|---|---|
| a tiny preset (``tiny``, ``small``, ``tiny-odd``) | ``save_tiny_model(dst, preset, seed)``; no download |
| ``shape:<name>`` (``llama-1b``, ``llama-8b``, ... ``fp8rl.models.shapes``) | random bf16 weights of that Llama shape and
  the character tokenizer (``make_shape_model``): what the throughput benchmarks time; no download |
| ``hf://<org>/<name>[@<revision>]`` | ``huggingface_hub.snapshot_download`` (safetensors, config, tokenizer files; ``$HF_TOKEN``) |
| ``file://<dir>`` or a directory path | copied (e.g. from a volume mounted into a pipeline step) |

Every imported checkpoint must be a supported local HF causal LM (``fp8rl.models.loading.read_model_config``);
the write is atomic, so a failed import leaves nothing behind.  The KFP ``prepare-model`` step and
``fp8rl import-model`` both call :func:`import_model`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from fp8rl.atomic import atomic_directory
from fp8rl.errors import UserError
from fp8rl.models.loading import read_model_config
from fp8rl.models.shapes import SHAPES, make_shape_model
from fp8rl.models.tiny import PRESETS, save_tiny_model

HF_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
SHAPE_SCHEME = "shape:"


def import_model(source: str, dst: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> dict[str, Any]:
    """Write the checkpoint named by ``source`` (module docstring) to ``dst``; ``seed`` only picks a tiny
    preset's weights.  Returns the model's origin, for an artifact's metadata: ``{"source": ...}``, and for a
    preset or a shape also ``preset``/``shape`` and ``seed``."""
    if source in PRESETS:
        save_tiny_model(dst, source, seed=int(seed), overwrite=overwrite)
        return {"source": f"tiny:{source}", "preset": source, "seed": int(seed)}
    if source.startswith(SHAPE_SCHEME):
        shape = source[len(SHAPE_SCHEME) :]
        if shape not in SHAPES:
            raise UserError(f"model source {source!r}: unknown model shape {shape!r}; expected one of {sorted(SHAPES)}")
        with atomic_directory(dst, overwrite=overwrite) as tmp:
            make_shape_model(shape, tmp, seed=int(seed))
        return {"source": source, "shape": shape, "seed": int(seed)}
    uri = urlparse(source)
    with atomic_directory(dst, overwrite=overwrite) as tmp:
        if uri.scheme == "hf":
            _download_hf(source, tmp)
        elif uri.scheme in ("", "file"):
            src = Path(uri.path if uri.scheme == "file" else source)
            if not source or not src.is_dir():  # "" would be the working directory
                raise UserError(
                    f"model source {source!r}: not a tiny preset {sorted(PRESETS)} nor an existing checkpoint "
                    f"directory (a volume must be mounted where this runs)"
                )
            shutil.copytree(src, tmp, dirs_exist_ok=True)
        else:
            raise UserError(
                f"model source {source!r}: unsupported scheme {uri.scheme!r}; expected a tiny preset "
                f"{sorted(PRESETS)}, shape:<name>, a directory, file://<dir> or hf://<org>/<name>[@<revision>]"
            )
        read_model_config(tmp)  # a supported HF causal LM, or a UserError naming the file
    return {"source": source}


def _download_hf(source: str, dst: Path) -> None:
    """``hf://<org>/<name>[@<revision>]`` -> the repository's config, safetensors and tokenizer files in ``dst``."""
    from huggingface_hub import snapshot_download

    uri = urlparse(source)
    repo, _, revision = (uri.netloc + uri.path).partition("@")
    if repo.count("/") != 1:
        raise UserError(f"model source {source!r}: expected hf://<org>/<name>[@<revision>]")
    try:
        snapshot_download(
            repo,
            revision=revision or None,
            local_dir=dst,
            allow_patterns=HF_PATTERNS,
            token=os.environ.get("HF_TOKEN") or None,
        )
    except OSError as e:  # huggingface_hub's HTTP, not-found, gated and offline errors are all OSErrors
        raise UserError(f"model source {source!r}: download failed ({type(e).__name__}: {e})") from e
