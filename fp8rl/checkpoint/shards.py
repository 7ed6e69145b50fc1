"""Reading Hugging Face safetensors checkpoints shard by shard."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from fp8rl.errors import UserError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(UserError, ValueError):
    """A checkpoint directory or one of its files is not usable; the message names it."""


@dataclass(frozen=True)
class ShardLayout:
    """The weight files of a checkpoint: one file, or several with an index."""

    files: list[str]
    sharded: bool


def shard_layout(root: Path) -> ShardLayout:
    index = root / INDEX_NAME
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that do not exist: {missing}")
        return ShardLayout(files, sharded=True)
    if (root / SINGLE_NAME).is_file():
        return ShardLayout([SINGLE_NAME], sharded=False)
    raise CheckpointError(f"{root}: no {SINGLE_NAME} or {INDEX_NAME} (only safetensors checkpoints are supported)")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tree_digest(file_hashes: dict[str, str]) -> str:
    """One hash for a set of files: sha256 over sorted ``name  sha256`` lines."""
    lines = "".join(f"{name}  {digest}\n" for name, digest in sorted(file_hashes.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def write_index(dst: Path, files: list[str], weight_map: dict[str, str]) -> None:
    """Write ``model.safetensors.index.json`` for the shards ``files`` already in ``dst``."""
    total = sum((dst / f).stat().st_size for f in files)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def copy_side_files(src: Path, dst: Path, skip: set[str]) -> None:
    """Copy the non-weight files of a checkpoint (tokenizer, generation config, ...) except ``skip``."""
    for item in src.iterdir():
        if item.is_file() and item.name not in skip and not item.name.startswith("fp8rl_"):
            shutil.copy2(item, dst / item.name)
