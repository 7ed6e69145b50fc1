"""FP8 checkpoint -> high-precision checkpoint, for inspection and for consumers without FP8 kernels."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from fp8rl.atomic import atomic_directory
from fp8rl.checkpoint.convert import write_manifest
from fp8rl.checkpoint.formats import BLOCK_SCALE_SUFFIX, CT_SCALE_SUFFIX, read_granularity
from fp8rl.checkpoint.shards import INDEX_NAME, CheckpointError, copy_side_files, shard_layout, write_index
from fp8rl.models.loading import read_model_config
from fp8rl.quant import E4M3, E5M2, QuantizedTensor, dequantize


def dequantize_weight(
    data: torch.Tensor, scale: torch.Tensor, granularity: str, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """Dequantize one stored FP8 weight: ``q * scale`` in float32, rounded once to ``dtype``."""
    fmt = E4M3 if data.dtype == torch.float8_e4m3fn else E5M2
    if granularity == "tensor":
        scale = scale.reshape(())
    q = QuantizedTensor(data, scale, granularity, fmt, block if granularity == "block" else None)  # type: ignore[arg-type]
    return dequantize(q, dtype)


def dequantize_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
    show_progress: bool = True,
) -> Path:
    """Write a copy of the FP8 checkpoint at ``src`` with every FP8 weight dequantized to ``dtype``."""
    src_path = Path(src)
    cfg = read_model_config(src_path)
    qcfg = cfg.get("quantization_config")
    if qcfg is None:
        raise CheckpointError(f"{src_path / 'config.json'}: no quantization_config; not an FP8 checkpoint")
    try:
        granularity, block = read_granularity(qcfg)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{src_path / 'config.json'}: quantization_config not understood: {e}") from e
    scale_suffix = BLOCK_SCALE_SUFFIX if granularity == "block" else CT_SCALE_SUFFIX
    layout = shard_layout(src_path)
    weight_map: dict[str, str] = {}
    with atomic_directory(dst, overwrite=overwrite) as tmp:
        for file in tqdm(layout.files, desc="dequantize", unit="shard", disable=not show_progress):
            out: dict[str, torch.Tensor] = {}
            with safe_open(str(src_path / file), framework="pt") as f:
                names = set(f.keys())
                for name in names:
                    if name.endswith(scale_suffix):
                        continue
                    t = f.get_tensor(name)
                    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                        sname = name.removesuffix(".weight") + scale_suffix
                        if sname not in names:
                            raise CheckpointError(f"{src_path / file}: FP8 tensor {name} has no {sname}")
                        t = dequantize_weight(t, f.get_tensor(sname), granularity, block, dtype)
                    out[name] = t
            save_file(out, str(tmp / file), metadata={"format": "pt"})
            weight_map.update({name: file for name in out})
        if layout.sharded:
            write_index(tmp, layout.files, weight_map)
        cfg_out = {k: v for k, v in cfg.items() if k != "quantization_config"}
        (tmp / "config.json").write_text(json.dumps(cfg_out, indent=2) + "\n")
        copy_side_files(src_path, tmp, {*layout.files, INDEX_NAME, "config.json"})
        write_manifest(tmp, {"kind": "dequantized-checkpoint", "source": {"path": str(src_path.resolve())}})
    return Path(dst)
