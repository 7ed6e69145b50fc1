"""Gemma 3's text model (``gemma3_text``) as a supported family, on a tiny random one (no download): its decoder
linears are the FP8 ones, whole 128-tiles convert with block scaling, and both engines' FP8 paths run on it.  The
real Gemma-3-270M: tests/integration/test_real_model_gemma3.py (opt-in)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8rl.checkpoint import ConvertOptions, convert_checkpoint
from fp8rl.models.layers import fp8_module_names
from fp8rl.models.loading import load_causal_lm, read_model_config
from fp8rl.rollout.base import SamplingParams
from fp8rl.rollout.torch_engine import TorchRolloutEngine


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128, sliding_window=8, layer_types=["sliding_attention", "sliding_attention",
        "full_attention"], max_position_embeddings=64, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    dst = tmp_path_factory.mktemp("gemma3") / "model"
    Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(dst)
    return dst


def test_gemma3_text_is_supported_and_its_decoder_linears_go_fp8(tiny_gemma3: Path, tmp_path: Path) -> None:
    assert read_model_config(tiny_gemma3)["model_type"] == "gemma3_text"
    model = load_causal_lm(tiny_gemma3)
    names = fp8_module_names(model)
    assert len(names) == 3 * 7 and "model.layers.2.self_attn.q_proj" in names
    assert not any("norm" in n or "embed" in n or "lm_head" in n for n in names)
    report = convert_checkpoint(tiny_gemma3, tmp_path / "fp8", ConvertOptions(), show_progress=False)
    assert not report.kept_partial_tiles  # every width a multiple of 128: block scaling takes all 21


def test_torch_engine_generates_in_fp8_on_gemma3(tiny_gemma3: Path) -> None:
    prompts = [[2, 5, 6, 7], [2, 9]]
    outs = {}
    for precision in ("bf16", "fp8"):
        engine = TorchRolloutEngine(tiny_gemma3, precision)
        out = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=6, seed=0))
        assert torch.isfinite(out.logprobs).all() and out.response_ids.shape == (2, 6)
        outs[precision] = out.logprobs
    assert not torch.equal(outs["bf16"], outs["fp8"])  # the FP8 linears are in the path
