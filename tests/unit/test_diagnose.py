"""fp8rl diagnose: per-layer FP8 disagreement on a real (tiny) model, the BF16-layer recommendation, the report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fp8rl.cli import main
from fp8rl.diagnose import candidate_settings, diagnose, fp8_layers, response_logprobs, sample_sequences, write_report
from fp8rl.models.loading import load_tokenizer
from fp8rl.quant import QuantSpec
from fp8rl.rollout.torch_engine import TorchRolloutEngine
from fp8rl.tasks import ArithmeticTask
from fp8rl.tasks.prompts import PromptFormat


def test_candidates_fewest_bf16_layers_first() -> None:
    assert list(candidate_settings(2)) == [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2)]


def test_fp8_layers_swaps_and_restores(tiny_models: dict[str, Path]) -> None:
    engine = TorchRolloutEngine(tiny_models["small"], "bf16")
    tok = load_tokenizer(tiny_models["small"])
    batch = sample_sequences(engine, tok, ArithmeticTask().examples("test", 8), PromptFormat(), 6, seed=0)
    before = response_logprobs(engine.model, batch)
    with fp8_layers(engine.model, {1}, QuantSpec()):
        kinds = {type(engine.model.get_submodule(f"model.layers.{i}.mlp.up_proj")).__name__ for i in (0, 1)}
        assert kinds == {"Linear", "FP8InferenceLinear"}
        during = response_logprobs(engine.model, batch)
    assert not torch.equal(before, during)
    assert torch.equal(before, response_logprobs(engine.model, batch))  # the BF16 linears are back
    with pytest.raises(ValueError, match="outside"), fp8_layers(engine.model, {99}, QuantSpec()):
        pass


def test_diagnosis_attributes_and_recommends(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    examples = ArithmeticTask().examples("train", 16)
    loose = diagnose(tiny_models["small"], QuantSpec(), examples, target=1.5, max_tokens=6, log=lambda _s: None)
    n = len(loose.per_layer)
    assert n == 4 and all(t > 1.0 for t in loose.per_layer) and loose.tmpe_all_fp8 > 1.0
    assert loose.recommendation == {"first": 0, "last": 0, "tmpe": loose.tmpe_all_fp8}  # all-FP8 already passes
    strict = diagnose(tiny_models["small"], QuantSpec(), examples, target=1.0, max_tokens=6, log=lambda _s: None)
    # only all-BF16 is exactly 1.0: every setting with fewer BF16 layers was tried first
    assert strict.recommendation is not None and strict.recommendation["first"] + strict.recommendation["last"] == n
    assert strict.recommendation["tmpe"] == 1.0 and len(strict.candidates) == sum(k + 1 for k in range(n)) + 1
    out = write_report(strict, tmp_path / "report")
    md = (out / "diagnosis.md").read_text()
    assert "| layer (only it in FP8) |" in md and f"bf16_first_layers: {strict.recommendation['first']}" in md
    assert json.loads((out / "diagnosis.json").read_text())["per_layer"] == strict.per_layer
    assert (out / "per_layer.png").stat().st_size > 1000
    capped = diagnose(
        tiny_models["small"], QuantSpec(), examples, target=1.0, max_tokens=6, max_candidates=3, log=lambda _s: None
    )
    assert capped.recommendation is None and "no setting of up to 3" in capped.to_markdown()


def test_diagnose_command_errors(tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagnose", str(tiny_models["small"]), "--recipe", "bf16"]) == 2
    assert "rollout is BF16" in capsys.readouterr().err
    assert main(["diagnose", str(tiny_models["small"]), "--target", "0.5"]) == 2
    assert "--target must be >= 1.0" in capsys.readouterr().err


def test_diagnose_run_measures_the_scaling_the_rollout_serves(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """``rollout.fp8_scaling: channel``: the disagreement diagnosed is the per-channel rollout's, not the block
    trainer's (the report names the scaling)."""
    from fp8rl.config import load_recipe, parse_run_config
    from fp8rl.diagnose import diagnose_run

    def run(scaling: str) -> Any:
        cfg = parse_run_config({"recipe": load_recipe("fp8-e2e").model_dump(), "rollout": {"fp8_scaling": scaling}})
        return diagnose_run(cfg, tiny_models["small"], tmp_path / scaling, target=1.5, examples=8, max_tokens=4,
                            log=lambda _s: None)  # fmt: skip

    block, channel = run("recipe"), run("channel")
    assert block.spec["granularity"] == "block" and channel.spec["granularity"] == "row"
    assert channel.tmpe_all_fp8 != block.tmpe_all_fp8  # another quantization, another disagreement


def test_response_logprobs_are_the_whole_batch_log_softmax(tiny_models: dict[str, Path]) -> None:
    """Chunked (``token_logprobs``, no ``[batch, t, vocab]`` fp32 copy: Gemma 3's vocabulary is 262,144) and the same
    bits as the plain fp32 log-softmax of the whole micro-batch."""
    engine = TorchRolloutEngine(tiny_models["small"], "bf16")
    tok = load_tokenizer(tiny_models["small"])
    batch = sample_sequences(engine, tok, ArithmeticTask().examples("test", 6), PromptFormat(), 6, seed=0)
    got = response_logprobs(engine.model, batch, micro_batch=4)
    want = []
    with torch.no_grad():
        for s in range(0, 6, 4):
            b = batch.slice(slice(s, s + 4))
            logits = engine.model(
                input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids
            ).logits
            t = b.input_ids.shape[1] - b.prompt_width
            pred = logits[:, b.prompt_width - 1 : b.prompt_width - 1 + t, :].float()
            lp = pred.log_softmax(-1).gather(-1, b.input_ids[:, b.prompt_width :, None]).squeeze(-1)
            want.append(lp * b.response_mask)
    assert torch.equal(got, torch.cat(want))
