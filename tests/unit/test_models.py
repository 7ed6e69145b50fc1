"""Tiny model factory, char tokenizer and local HF loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fp8rl.atomic import OutputExistsError
from fp8rl.errors import UserError
from fp8rl.models import (
    CHAR_VOCAB,
    PRESETS,
    UnsupportedModelError,
    import_model,
    load_causal_lm,
    make_char_tokenizer,
    make_tiny_model,
    read_model_config,
)


def test_presets_exercise_whole_and_partial_blocks() -> None:
    for name, p in PRESETS.items():
        head_dim = p.hidden_size // p.num_attention_heads
        dims = [p.hidden_size, p.intermediate_size, p.num_key_value_heads * head_dim]
        whole = all(d % 128 == 0 for d in dims)
        assert whole == (name != "tiny-odd"), name
        assert head_dim == 64


def test_char_tokenizer_round_trips_task_text() -> None:
    tok = make_char_tokenizer()
    text = "Q: 12+34*5=?\nA: 182 #### 182 \\boxed{182}"
    ids = tok(text).input_ids
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert len(tok) == len(CHAR_VOCAB) + 4 <= PRESETS["tiny"].vocab_size
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0


def test_saved_model_loads_with_auto_classes(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["tiny"]
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    text = "7+8=15"
    assert tok(text).input_ids == make_char_tokenizer()(text).input_ids
    assert tok.decode(tok(text).input_ids) == text
    ref, _ = make_tiny_model("tiny", seed=0)
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    out = model(torch.tensor([tok(text).input_ids])).logits
    assert out.shape == (1, len(text), PRESETS["tiny"].vocab_size)


def test_sharded_save_has_index(tiny_models: dict[str, Path]) -> None:
    index = json.loads((tiny_models["small-sharded"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_seeds_differ() -> None:
    a, _ = make_tiny_model("tiny", seed=0)
    b, _ = make_tiny_model("tiny", seed=1)
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, b.model.layers[0].mlp.up_proj.weight)


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="tiny-odd"):
        make_tiny_model("huge")


def test_load_rejects_unsupported_architecture(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_model_config(tmp_path / "missing")
    with pytest.raises(UnsupportedModelError, match="config.json is missing"):
        read_model_config(tmp_path)
    cfg = json.loads((tiny_models["tiny"] / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        load_causal_lm(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="not valid JSON"):
        read_model_config(tmp_path)


def test_checkpoints_pin_only_the_char_tokenizer(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """The trainer's checkpoint pins the char tokenizer's class; a real model's tokenizer config stays as saved."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from fp8rl.config import OptimConfig
    from fp8rl.models.tokenizer import is_char_tokenizer
    from fp8rl.train.trainer import TorchTrainer, TrainerOptions

    trainer = TorchTrainer(tiny_models["tiny"], TrainerOptions(optim=OptimConfig(lr=2e-5, warmup_steps=0)))
    char = AutoTokenizer.from_pretrained(str(tiny_models["tiny"]))
    other = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab={"<unk>": 0, "a": 1}, merges=[], unk_token="<unk>")),
        unk_token="<unk>",
        model_max_length=32768,
    )
    assert is_char_tokenizer(char) and not is_char_tokenizer(other)
    trainer.save_checkpoint(tmp_path / "char", char)
    trainer.save_checkpoint(tmp_path / "other", other)
    pinned = json.loads((tmp_path / "char" / "tokenizer_config.json").read_text())
    kept = json.loads((tmp_path / "other" / "tokenizer_config.json").read_text())
    assert (pinned["tokenizer_class"], pinned["model_max_length"]) == ("PreTrainedTokenizerFast", 512)
    assert kept["model_max_length"] == 32768


# ---------------------------------------------------------------- model sources (import_model)


def test_import_model_replaces_only_with_overwrite(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    dst, small = tmp_path / "m", tiny_models["small"]
    assert import_model("tiny", dst, seed=1) == {"source": "tiny:tiny", "preset": "tiny", "seed": 1}
    before = (dst / "model.safetensors").read_bytes()
    for source in ("tiny", str(small)):
        with pytest.raises(OutputExistsError, match="--overwrite"):
            import_model(source, dst)
    assert (dst / "model.safetensors").read_bytes() == before
    assert import_model(str(small), dst, overwrite=True) == {"source": str(small)}
    assert (dst / "model.safetensors").read_bytes() == (small / "model.safetensors").read_bytes()


def test_import_model_writes_random_weights_of_a_named_shape(tmp_path: Path) -> None:
    from fp8rl.models.loading import read_model_config

    dst = tmp_path / "m"
    assert import_model("shape:tiny", dst, seed=3) == {"source": "shape:tiny", "shape": "tiny", "seed": 3}
    assert read_model_config(dst)["hidden_size"] == 128  # fp8rl.models.shapes.SHAPES["tiny"]
    with pytest.raises(OutputExistsError, match="--overwrite"):
        import_model("shape:tiny", dst)
    import_model("shape:tiny", dst, seed=4, overwrite=True)
    assert json.loads((dst / "fp8rl_bench_shape.json").read_text()) == {"shape": "tiny", "seed": 4}


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("", "not a tiny preset"),
        ("shape:llama-9b", "unknown model shape 'llama-9b'"),  # not the working directory
        ("hf://org/name@v1", "download failed"),  # the test session is offline (conftest: HF_HUB_OFFLINE=1)
    ],
)
def test_import_model_names_the_source_and_writes_nothing(tmp_path: Path, source: str, match: str) -> None:
    with pytest.raises(UserError, match=f"model source {source!r}: {match}"):
        import_model(source, tmp_path / "m")
    assert list(tmp_path.iterdir()) == []
