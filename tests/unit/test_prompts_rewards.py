"""Prompts (chat templates, system prompts, BOS), rewards (extraction, user Python functions) and task data
(JSONL / Parquet records, field maps, chat messages) as users bring them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fp8rl.config import ConfigError, load_recipe, parse_run_config
from fp8rl.models.tokenizer import make_char_tokenizer
from fp8rl.tasks import DatasetError, Example, load_examples
from fp8rl.tasks.prompts import PromptError, PromptFormat
from fp8rl.tasks.rewards import EXTRACTORS, ExactMatch, PythonReward, RewardError, load_reward_function

BF16 = load_recipe("bf16").model_dump()
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def chat_tokenizer() -> Any:
    tok = make_char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def test_without_a_template_prompts_are_unchanged_and_system_is_a_prefix() -> None:
    tok = make_char_tokenizer()
    ex = Example("12+7=", "19")
    assert PromptFormat().encode(tok, ex) == tok("12+7=").input_ids
    assert tok.decode(PromptFormat(system_prompt="Add.").encode(tok, ex)) == "Add.\n\n12+7="
    with pytest.raises(PromptError, match="'always'"):
        PromptFormat("always").encode(tok, ex)
    with pytest.raises(PromptError, match="messages"):
        PromptFormat().encode(tok, Example("hi", "1", messages=(("user", "hi"),)))


def test_chat_template_auto_always_never_and_system_turn() -> None:
    tok = chat_tokenizer()
    ex = Example("1+2=", "3")
    auto = tok.decode(PromptFormat().encode(tok, ex))
    assert auto == "<bos><user>1+2=\n<assistant>"
    assert PromptFormat("always").encode(tok, ex) == PromptFormat().encode(tok, ex)
    assert tok.decode(PromptFormat("never").encode(tok, ex)) == "1+2="
    with_system = tok.decode(PromptFormat(system_prompt="Be brief.").encode(tok, ex))
    assert with_system == "<bos><system>Be brief.\n<user>1+2=\n<assistant>"
    chat = Example("and 2+2?", "4", messages=(("user", "1+1?"), ("assistant", "2"), ("user", "and 2+2?")))
    assert tok.decode(PromptFormat().encode(tok, chat)) == "<bos><user>1+1?\n<assistant>2\n<user>and 2+2?\n<assistant>"


def test_a_bos_written_by_the_template_and_added_again_is_dropped() -> None:
    class DoubleBos:
        chat_template = "x"
        bos_token_id = 1

        def apply_chat_template(self, messages: Any, **kw: Any) -> dict[str, list[int]]:
            return {"input_ids": [1, 1, 7, 8]}

    assert PromptFormat().encode(DoubleBos(), Example("q", "a")) == [1, 7, 8]


@pytest.mark.parametrize(
    ("extract", "response", "answer", "reward"),
    [
        ("strict", "19", "19", 1.0),
        ("strict", "1 + 4 = 5", "5", 0.0),  # strict wants a marker or a bare number
        ("last-number", "1 + 4 = 5.", "5", 1.0),
        ("last-number", "so 1,234.50 apples", "1234.5", 1.0),
        ("last-number", "-3 or maybe 4", "4", 1.0),
        ("last-number", "no digits", "0", 0.0),
        ("boxed", "x \\boxed{7} then 9", "7", 1.0),
        ("boxed", "#### 7", "7", 0.0),
        ("gsm8k", "work... #### 72\nDone", "72", 1.0),
        ("gsm8k", "\\boxed{72}", "72", 0.0),
    ],
)
def test_exact_match_extraction_modes(extract: str, response: str, answer: str, reward: float) -> None:
    assert ExactMatch(extract).score([response], [Example("q", answer)]).rewards == [reward]  # type: ignore[arg-type]
    assert set(EXTRACTORS) == {"strict", "last-number", "boxed", "gsm8k"}


REWARD_FILE = """
import time

def length_bonus(response, answer, example):
    return float(response.strip() == answer) + 0.1 * example.get("difficulty", 0)

def broken(response, answer, example):
    raise RuntimeError("boom")

def slow(response, answer, example):
    time.sleep(3)
    return 1.0

def wrong_type(response, answer, example):
    return "1.0"
"""


def test_python_reward_scores_counts_errors_and_times_out(tmp_path: Path) -> None:
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    examples = [Example("q", "5", extra={"difficulty": 2}), Example("q", "6")]
    good = PythonReward(load_reward_function(f"{path}:length_bonus"), "length_bonus")
    got = good.score(["5", "7"], examples)
    assert got.rewards == pytest.approx([1.2, 0.0]) and got.errors == got.timeouts == 0

    broken = PythonReward(load_reward_function(f"{path}:broken"), "broken").score(["5", "6"], examples)
    assert broken.rewards == [0.0, 0.0] and broken.errors == 2 and "RuntimeError: boom" in (broken.first_error or "")
    typed = PythonReward(load_reward_function(f"{path}:wrong_type"), "wrong_type").score(["5"], examples[:1])
    assert typed.errors == 1 and "expected a float" in (typed.first_error or "")

    slow = PythonReward(load_reward_function(f"{path}:slow"), "slow", timeout_s=0.2, workers=2)
    t0 = time.monotonic()
    out = slow.score(["5", "6"], examples)
    assert time.monotonic() - t0 < 2.0  # the step does not wait for the slow reward
    assert out.rewards == [0.0, 0.0] and out.timeouts == 2 and out.metrics()["reward/timeouts"] == 2.0


def test_python_reward_load_errors_name_the_file_and_function(tmp_path: Path) -> None:
    path = tmp_path / "r.py"
    path.write_text(REWARD_FILE)
    (tmp_path / "bad.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(RewardError, match="does not exist"):
        load_reward_function(f"{tmp_path / 'nope.py'}:f")
    with pytest.raises(RewardError, match=f"{path} has no function 'missing'"):
        load_reward_function(f"{path}:missing")
    with pytest.raises(RewardError, match="importing .*bad.py failed: ModuleNotFoundError"):
        load_reward_function(f"{tmp_path / 'bad.py'}:f")
    with pytest.raises(RewardError, match="expected 'path/to/file.py:function_name'"):
        load_reward_function("r.py")


def test_records_with_messages_extra_fields_and_a_gsm8k_field_map(tmp_path: Path) -> None:
    rows = [
        {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}], "answer": "4",
         "source": "unit"},
        {"prompt": "3+3=", "answer": "6", "difficulty": 1},
    ]  # fmt: skip
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    chat, plain = load_examples(f)
    assert chat.messages == (("system", "Be terse."), ("user", "2+2?")) and chat.prompt == "2+2?"
    assert chat.extra == {"source": "unit"} and plain.extra == {"difficulty": 1} and plain.messages is None

    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "Janet has 3...", "answer": "She has <<3*24=72>>72\n#### 72"}))
    (ex,) = load_examples(gsm, {"prompt": "question"})
    assert ex.prompt == "Janet has 3..." and ex.answer == "72"

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                               "answer": "1"}))  # fmt: skip
    with pytest.raises(DatasetError, match=f"{bad}:1: the last of 'messages' must be a user turn"):
        load_examples(bad)


def test_parquet_records(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"question": "1+1=", "answer": "2"}, {"question": "2+5=", "answer": "7"}]), path
    )
    assert [e.answer for e in load_examples(path, {"prompt": "question"})] == ["2", "7"]
    with pytest.raises(DatasetError, match="row 0: missing key 'prompt'"):
        load_examples(path)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetError, match=f"{broken}: not a readable Parquet file"):
        load_examples(broken)


def test_run_config_takes_task_formats_and_rewards(tmp_path: Path) -> None:
    cfg = parse_run_config(
        {
            "recipe": BF16,
            "task": {
                "type": "parquet",
                "train": "a.parquet",
                "test": "b.parquet",
                "fields": {"prompt": "question"},
                "chat_template": "always",
                "system_prompt": "S",
            },
            "reward": {"type": "python", "function": "rewards.py:score", "timeout_s": 2},
        }
    )
    assert cfg.task.type == "parquet" and cfg.task.chat_template == "always"
    assert cfg.reward.type == "python" and cfg.reward.timeout_s == 2
    assert parse_run_config({"recipe": BF16}).reward.extract == "strict"  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="reward"):
        parse_run_config({"recipe": BF16, "reward": {"type": "python", "function": "rewards.py"}})
    with pytest.raises(ConfigError, match="chat_template"):
        parse_run_config({"recipe": BF16, "task": {"type": "arithmetic", "chat_template": "sometimes"}})


def test_documented_example_config_and_reward_work() -> None:
    import yaml

    root = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((root / "docs/configs/custom-task.yaml").read_text())
    cfg = parse_run_config({**data, "recipe": BF16}, "docs/configs/custom-task.yaml")
    assert cfg.task.fields.prompt == "question" and cfg.reward.type == "python"  # type: ignore[union-attr]
    fn = load_reward_function(str(root / cfg.reward.function))  # type: ignore[union-attr]
    reward = PythonReward(fn, "score")
    got = reward.score(["It is 72.", "73"], [Example("q", "72", extra={"weight": 2.0}), Example("q", "72")])
    assert got.rewards == pytest.approx([2.2, 0.0]) and got.errors == 0


HANGING_REWARD = """
import threading

def never_returns(response, answer, example):
    threading.Event().wait()  # blocks forever, as a reward stuck on a lock or a dead socket does
"""

SCORE_AND_EXIT = """
import sys
from fp8rl.tasks.rewards import PythonReward, load_reward_function
from fp8rl.tasks.verify import Example

reward = PythonReward(load_reward_function(sys.argv[1]), "never_returns", timeout_s=0.2, workers=2)
out = reward.score(["5", "6", "7"], [Example("q", "5")] * 3)
print("timeouts", out.timeouts, flush=True)
"""


def test_a_reward_that_never_returns_does_not_block_the_process_exit(tmp_path: Path) -> None:
    """The calls past their timeout hold their threads forever; the process still exits when its work is done
    (a pool joined at exit would hang it: the RL step never finishes, the pod never ends)."""
    path = tmp_path / "hang.py"
    path.write_text(HANGING_REWARD)
    # the bound is the interpreter's start and fp8rl's imports many times over; a hang is killed at it and fails
    done = subprocess.run(
        [sys.executable, "-c", SCORE_AND_EXIT, f"{path}:never_returns"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "timeouts 3" in done.stdout
