"""Stop and pad ids from a checkpoint's config, generation config and tokenizer (``fp8rl.models.special_tokens``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fp8rl.models.special_tokens import SpecialTokenError, resolve_special_tokens, special_tokens
from fp8rl.rollout.base import SamplingParams
from fp8rl.rollout.torch_engine import TorchRolloutEngine


def test_llama3_style_lists_and_a_chat_turn_end_become_one_ordered_stop_list() -> None:
    # Llama-3.1-Instruct: config and generation config list three ids; the tokenizer's eos is <|eot_id|>
    got = resolve_special_tokens(
        {"eos_token_id": [128001, 128008, 128009], "vocab_size": 128256},
        {"eos_token_id": [128001, 128008, 128009]},
        tokenizer_eos=128009,
    )
    assert got.stop_ids == (128009, 128001, 128008) and got.eos_id == 128009
    assert got.pad_id == 128009  # no pad anywhere: the eos pads (always masked)


def test_qwen_style_config_eos_differs_from_the_tokenizers() -> None:
    # Qwen2.5-Instruct: config eos <|im_end|>, generation config [<|im_end|>, <|endoftext|>], pad <|endoftext|>
    got = resolve_special_tokens(
        {"eos_token_id": 151645, "vocab_size": 151936}, {"eos_token_id": [151645, 151643], "pad_token_id": 151643},
        tokenizer_eos=151645, tokenizer_pad=151643,
    )  # fmt: skip
    assert got.stop_ids == (151645, 151643) and got.pad_id == 151643


def test_no_eos_anywhere_or_ids_outside_the_vocabulary_are_errors_naming_the_source() -> None:
    with pytest.raises(SpecialTokenError, match="/m: no eos_token_id in the tokenizer, generation_config.json"):
        resolve_special_tokens({"vocab_size": 10}, None, source="/m")
    with pytest.raises(SpecialTokenError, match=r"/m: token ids \[12\] are outside the vocabulary \(vocab_size 10\)"):
        resolve_special_tokens({"vocab_size": 10, "eos_token_id": 12}, source="/m")
    with pytest.raises(SpecialTokenError, match="/m: eos_token_id / pad_token_id"):
        resolve_special_tokens({"eos_token_id": "two"}, source="/m")


def test_generation_config_eos_stops_the_torch_engine(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A checkpoint whose generation_config.json adds a second stop id: the engine stops on it too, and a broken
    generation_config.json is an error naming the file."""
    model = tmp_path / "m"
    shutil.copytree(tiny_models["tiny"], model)
    base = special_tokens(model)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, seed=0)
    prompt = [[1, 20, 21, 22]]
    first = TorchRolloutEngine(model, "bf16").generate(prompt, greedy)
    token = int(first.response_ids[0, 0])  # whatever the random model says first becomes a stop id
    assert token not in base.stop_ids
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [base.eos_id, token]}))
    assert special_tokens(model).stop_ids == (*base.stop_ids, token)
    engine = TorchRolloutEngine(model, "bf16")
    assert engine.stop_token_ids == [*base.stop_ids, token]
    out = engine.generate(prompt, greedy)
    assert int(out.response_mask[0].sum()) == 1 and torch.equal(out.response_ids[0, :1], first.response_ids[0, :1])
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(SpecialTokenError, match="generation_config.json: not valid JSON"):
        special_tokens(model)
