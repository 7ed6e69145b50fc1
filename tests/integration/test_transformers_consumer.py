"""An independent consumer: transformers' own FP8 loader reads fp8rl's block-FP8 checkpoint.

On a machine without FP8 kernels transformers dequantizes the checkpoint to bf16 on load
(FineGrainedFP8 with ``dequantize=True``); its weights must equal ``fp8rl dequantize``'s
bit for bit, and its logits must stay within the tolerance derived below.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fp8rl.checkpoint import ConvertOptions, convert_checkpoint, dequantize_checkpoint
from fp8rl.config import QuantConfig
from fp8rl.models import PRESETS

pytest.importorskip("accelerate", reason="transformers' FP8 loader needs accelerate")

# Per-tensor RMS relative error of e4m3 rounding (see test_report_error_matches_e4m3_theory).
EPS_E4M3 = 2.0**-3 / math.sqrt(12) * math.sqrt(3 / (8 * math.log(2)))


@pytest.mark.parametrize("bf16_first", [0, 1])
def test_transformers_loads_block_fp8(tmp_path: Path, tiny_models: dict[str, Path], bf16_first: int) -> None:
    src = tiny_models["small-sharded"]
    fp8, deq = tmp_path / "fp8", tmp_path / "deq"
    convert_checkpoint(src, fp8, ConvertOptions(QuantConfig(bf16_first_layers=bf16_first)), show_progress=False)
    dequantize_checkpoint(fp8, deq, show_progress=False)

    loaded = AutoModelForCausalLM.from_pretrained(fp8)
    ours = AutoModelForCausalLM.from_pretrained(deq)
    ref = AutoModelForCausalLM.from_pretrained(src)
    sd_loaded, sd_ours = loaded.state_dict(), ours.state_dict()
    assert set(sd_loaded) == set(sd_ours)
    for name, t in sd_loaded.items():
        assert torch.equal(t, sd_ours[name]), f"{name} differs from fp8rl dequantize"
    assert not torch.equal(
        sd_loaded["model.layers.2.mlp.up_proj.weight"], ref.state_dict()["model.layers.2.mlp.up_proj.weight"]
    )

    # Tolerance: n quantized linears on the residual path each add an independent
    # relative perturbation of size EPS_E4M3 to a unit-gain map (random init); to first
    # order these add in quadrature, so ||dlogits|| / ||logits|| ~ EPS * sqrt(n).
    n = 7 * (PRESETS["small"].num_hidden_layers - bf16_first)
    tol = EPS_E4M3 * math.sqrt(n)
    ids = torch.randint(4, 100, (4, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = loaded(ids).logits.double(), ref(ids).logits.double()
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < tol, f"logits relative error {rel:.4f} exceeds derived tolerance {tol:.4f}"


def test_transformers_loads_a_model_with_partial_tiles(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """tiny-odd's linears are not whole 128x128 tiles (as SmolLM's 192-row k/v and 576-wide inputs are not): the
    converter keeps them in bf16, names them in modules_to_not_convert and the report, and transformers loads it."""
    import json

    src = tiny_models["tiny-odd"]
    fp8, deq = tmp_path / "fp8", tmp_path / "deq"
    report = convert_checkpoint(src, fp8, ConvertOptions(), show_progress=False, allow_unquantized=True)
    kept = {m["module"] for m in report.kept_partial_tiles}
    assert kept and all("not whole 128x128 tiles" in m["reason"] for m in report.kept_partial_tiles)
    qcfg = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert kept <= set(qcfg["modules_to_not_convert"])
    assert "not whole weight tiles" in (fp8 / "fp8rl_conversion_report.md").read_text()

    dequantize_checkpoint(fp8, deq, show_progress=False)
    loaded, ours = AutoModelForCausalLM.from_pretrained(fp8), AutoModelForCausalLM.from_pretrained(deq)
    ref = AutoModelForCausalLM.from_pretrained(src)
    sd_loaded, sd_ours, sd_ref = loaded.state_dict(), ours.state_dict(), ref.state_dict()
    for name, t in sd_loaded.items():
        assert torch.equal(t, sd_ours[name]), f"{name} differs from fp8rl dequantize"
        if name.removesuffix(".weight") in kept:
            assert torch.equal(t, sd_ref[name]), f"{name} was kept in bf16 but changed"
    quantized = [m.name for m in report.tensors]
    assert all(not torch.equal(sd_loaded[n], sd_ref[n]) for n in quantized[:3])
    ids = torch.randint(4, 60, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(loaded(ids).logits).all()
