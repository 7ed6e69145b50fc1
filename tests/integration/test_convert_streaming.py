"""Conversion streams shard by shard: peak memory follows the largest shard, not the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

LAYERS, SHARDS = 16, 16
SHAPE = (1024, 2048)  # fp32: 8 MiB per tensor, 2 per layer -> 16 MiB per shard, 256 MiB model

PROBE = """
import resource, sys
import fp8rl.checkpoint as c
if sys.argv[1] == "convert":
    c.convert_checkpoint(sys.argv[2], sys.argv[3], show_progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _synthetic_checkpoint(root: Path) -> int:
    root.mkdir()
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": LAYERS}
    (root / "config.json").write_text(json.dumps(cfg))
    weight_map, total = {}, 0
    gen = torch.Generator().manual_seed(0)
    for i in range(SHARDS):
        name = f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        tensors = {
            f"model.layers.{i}.mlp.up_proj.weight": torch.randn(SHAPE, generator=gen),
            f"model.layers.{i}.mlp.down_proj.weight": torch.randn(SHAPE[::-1], generator=gen),
        }
        save_file(tensors, root / name)
        total += sum(t.numel() * 4 for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


def _peak_rss(*args: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, *args], check=True, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_peak_memory_is_well_under_model_size(tmp_path: Path) -> None:
    model_bytes = _synthetic_checkpoint(tmp_path / "src")
    baseline = _peak_rss("import-only")
    peak = _peak_rss("convert", str(tmp_path / "src"), str(tmp_path / "dst"))
    used = peak - baseline
    assert (tmp_path / "dst" / "fp8rl_manifest.json").exists()
    # one 16 MiB shard in, its fp32 working copies and its 8 MiB output: a few shards' worth
    assert used < 0.4 * model_bytes, f"conversion used {used / 2**20:.0f} MiB for a {model_bytes / 2**20:.0f} MiB model"
