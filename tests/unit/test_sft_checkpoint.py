"""The supervised warm-up of a given checkpoint on a run config's task (``fp8rl.supervised``, ``fp8rl sft --model``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fp8rl.cli import main
from fp8rl.config import load_recipe, parse_run_config
from fp8rl.models.loading import load_tokenizer
from fp8rl.supervised import SFT_RECORD, SFTSettings, sft_checkpoint
from fp8rl.tasks import Example
from fp8rl.tasks.prompts import PromptFormat
from fp8rl.train.sft import answer_batch, answer_ids


class _Template:
    """A tokenizer stand-in with a chat template: only ``uses_template`` reads it."""

    chat_template = "{{ messages }}"


@pytest.mark.parametrize(
    ("prompt", "target"),
    [("How many? Give the number.", " 7"), ("3+4=", "7"), ("Answer:\n", "7"), ("Answer: ", "7")],
)
def test_the_answer_follows_raw_prompt_text_as_running_text_and_ends_with_eos(
    prompt: str, target: str, tiny_models: dict[str, Path]
) -> None:
    tok = load_tokenizer(tiny_models["tiny"])
    ids = answer_ids(tok, PromptFormat("never"), Example(prompt, "7"), eos_id=99)
    assert ids[-1] == 99
    assert tok.decode(ids[:-1]) == target


def test_under_a_chat_template_the_answer_is_the_turn_text() -> None:
    seen: list[str] = []

    def tokenizer(text: str, add_special_tokens: bool) -> Any:
        assert add_special_tokens is False  # the template wrote the turn's special tokens already
        seen.append(text)
        return type("Out", (), {"input_ids": [5, 6]})()

    tokenizer.chat_template = _Template.chat_template  # type: ignore[attr-defined]
    assert answer_ids(tokenizer, PromptFormat("auto"), Example("q", "42"), eos_id=2) == [5, 6, 2]
    assert seen == ["42"]


def test_the_batch_masks_exactly_the_answer_tokens(tiny_models: dict[str, Path]) -> None:
    tok = load_tokenizer(tiny_models["tiny"])
    fmt = PromptFormat("never")
    examples = [Example("1+2=", "3"), Example("10+20=", "30")]
    batch = answer_batch(tok, fmt, examples, eos_id=1, pad_id=0)
    counts = batch.response_mask.sum(-1).tolist()
    assert counts == [len(answer_ids(tok, fmt, e, 1)) for e in examples]
    # the prompts are left-padded up to the response start, then the answer + eos
    start = batch.prompt_width
    for row, e in enumerate(examples):
        want = answer_ids(tok, fmt, e, 1)
        assert batch.input_ids[row, start : start + len(want)].tolist() == want
        assert batch.input_ids[row, start - len(fmt.encode(tok, e)) : start].tolist() == fmt.encode(tok, e)


def _cfg(**task: Any) -> Any:
    return parse_run_config(
        {"recipe": load_recipe("bf16"), "eval_examples": 24,
         "task": {"type": "arithmetic", "max_operand": 9, "operators": ["+"], **task},
         "sampling": {"max_tokens": 4}, "optim": {"micro_batch_size": 16}},
        "test",
    )  # fmt: skip


def test_sft_of_a_checkpoint_learns_the_answers_and_writes_its_record(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "warm"
    settings = SFTSettings(steps=40, batch_size=32, lr=3e-3, seed=0, eval_every=20)
    record = sft_checkpoint(_cfg(), tiny_models["tiny"], out, settings)
    losses = [loss for _, loss in record["loss"]]
    assert losses[-1] < 0.7 * losses[0]  # logged from step 10 on
    assert [s for s, _ in record["heldout_accuracy"]] == [s for s, _ in record["heldout_loss"]] == [0, 20, 40]
    assert all(0.0 <= acc <= 1.0 for _, acc in record["heldout_accuracy"])
    # What the held-out problems show of learning is their answer loss: greedy accuracy on them moves in steps of
    # one problem, and when the tiny model's first right answer appears depends on the CPU's rounding (0 -> 0.077
    # -> 0 on one machine, 0 -> 0.077 -> 0.154 on another).  Here the loss went 4.91 -> 1.22 -> 1.06: the bound
    # leaves twice that drop's margin.
    loss0, loss20, loss40 = (loss for _, loss in record["heldout_loss"])
    assert max(loss20, loss40) < 0.5 * loss0
    on_disk = json.loads((out / SFT_RECORD).read_text())
    assert on_disk["heldout_accuracy"] == record["heldout_accuracy"]
    assert on_disk["settings"]["lr"] == 3e-3 and on_disk["task"]["type"] == "arithmetic"
    assert (out / "config.json").is_file() and load_tokenizer(out) is not None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".warm")]  # no temporary left beside it


def test_an_existing_output_is_refused_before_any_training(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "warm"
    out.mkdir()
    with pytest.raises(Exception, match="already exists"):
        sft_checkpoint(_cfg(), tiny_models["tiny"], out, SFTSettings(steps=1))


def test_cli_sft_of_a_checkpoint(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        "task: {type: arithmetic, max_operand: 9, operators: ['+']}\neval_examples: 8\nsampling: {max_tokens: 4}\n"
    )
    out = tmp_path / "warm"
    argv = ["sft", "--model", str(tiny_models["tiny"]), "--config", str(config), "--output-dir", str(out),
            "--steps", "2", "--batch-size", "4", "--device", "cpu", "--set", "optim.micro_batch_size=4"]  # fmt: skip
    assert main(argv) == 0
    assert "held-out accuracy" in capsys.readouterr().out
    assert json.loads((out / SFT_RECORD).read_text())["settings"]["steps"] == 2
    assert main(argv) == 2  # the output exists now
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sft", "--config", "x.yaml"], "add --model"),
        (["sft", "--model", "m"], "needs --config"),
        (["sft", "--model", "m", "--config", "{cfg}", "--output-dir", "o", "--lr", "0"], "--lr must be > 0"),
        (["sft", "--model", "m", "--config", "{cfg}", "--output-dir", "o", "--set", "task.nope=1"], "nope"),
    ],
)
def test_cli_sft_bad_input_names_the_flag(
    argv: list[str], message: str, tmp_path: Path, tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("task: {type: arithmetic}\n")
    values = {"m": str(tiny_models["tiny"]), "{cfg}": str(config), "o": str(tmp_path / "o")}
    assert main([*(values.get(a, a) for a in argv), "--device", "cpu"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
