"""Verifiable tasks: arithmetic generation and splits, answer extraction, reward, JSONL loading."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8rl.errors import UserError
from fp8rl.models.tokenizer import CHAR_VOCAB
from fp8rl.tasks import (
    ArithmeticTask,
    DatasetError,
    Example,
    exact_match_reward,
    extract_answer,
    load_jsonl,
    normalize_answer,
    write_jsonl,
)

TASKS = [
    ArithmeticTask(),
    ArithmeticTask(max_operand=99, operators=("+", "-", "*"), num_operands=3, seed=3),
    ArithmeticTask(max_operand=5, operators=("*",), num_operands=2, seed=1),
    ArithmeticTask(max_operand=10**6, operators=("-", "*"), num_operands=4, seed=7),
]
EXPRESSION = re.compile(r"[0-9]+(?:[-+*][0-9]+)+=")


def reference_value(prompt: str) -> int:
    """Python's own integer arithmetic on the prompt (validated to digits and + - * only)."""
    assert EXPRESSION.fullmatch(prompt), prompt
    return int(eval(prompt[:-1], {"__builtins__": {}}))


# --- arithmetic --------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS, ids=str)
def test_answers_match_python_arithmetic(task: ArithmeticTask) -> None:
    for split in ("train", "test"):
        for ex in task.examples(split, 300):
            assert ex.answer == str(reference_value(ex.prompt)), ex
            operands = [int(x) for x in re.split(r"[-+*]", ex.prompt[:-1])]
            assert len(operands) == task.num_operands and all(0 <= x <= task.max_operand for x in operands)
            assert set(re.findall(r"[-+*]", ex.prompt)) <= set(task.operators)
            assert ArithmeticTask.sft_text(ex) == ex.prompt + ex.answer
            assert len(task.sft_text(ex)) <= task.max_sft_chars


def test_subtraction_gives_negative_answers_and_precedence_is_pythons() -> None:
    answers = [int(ex.answer) for ex in ArithmeticTask().examples("train", 200)]
    assert min(answers) < 0 < max(answers)
    task = ArithmeticTask(max_operand=9, operators=("-", "*"), num_operands=3)
    assert any("-" in ex.prompt and "*" in ex.prompt for ex in task.examples("train", 50))


@pytest.mark.parametrize("task", TASKS, ids=str)
def test_all_characters_are_in_the_tokenizer_vocab(task: ArithmeticTask) -> None:
    chars = {c for ex in task.examples("train", 500) + task.examples("test", 100) for c in task.sft_text(ex)}
    assert chars <= set(CHAR_VOCAB)


def test_examples_are_deterministic_and_seeds_differ() -> None:
    a = ArithmeticTask(max_operand=50, seed=0)
    assert a.examples("train", 200) == ArithmeticTask(max_operand=50, seed=0).examples("train", 200)
    assert a.examples("test", 50) == a.examples("test", 50)
    b = ArithmeticTask(max_operand=50, seed=1)
    assert a.examples("train", 200) != b.examples("train", 200)
    assert a.examples("test", 50) != b.examples("test", 50)
    # ... but a seed changes the order, not the split: a test problem is a test problem for every seed.
    assert set(a.examples("test", 2_000)) == set(b.examples("test", 2_000))


def test_a_prefix_of_n_examples_is_the_smaller_request() -> None:
    task = TASKS[1]
    assert task.examples("train", 1000)[:137] == task.examples("train", 137)
    assert task.examples("test", 400)[:20] == task.examples("test", 20)
    assert task.examples("test", 0) == []


@pytest.mark.parametrize("task", TASKS, ids=str)
def test_train_and_test_are_disjoint(task: ArithmeticTask) -> None:
    train = {ex.prompt for ex in task.examples("train", 10_000)}
    test = {ex.prompt for ex in task.examples("test", 3_000)}
    assert train and test and not train & test


def test_split_is_independent_of_seed_and_difficulty() -> None:
    easy_test = {ex.prompt for ex in ArithmeticTask(max_operand=20, seed=0).examples("test", 1000)}
    hard_train = {ex.prompt for ex in ArithmeticTask(max_operand=40, seed=5).examples("train", 20_000)}
    assert not easy_test & hard_train


def test_test_fraction_and_distinct_until_exhausted() -> None:
    task = ArithmeticTask()  # 21 * 21 * 2 = 882 problems
    n_test = len(set(task.examples("test", 2000)))
    n_train = len(set(task.examples("train", 5000)))
    assert n_test + n_train == task.num_problems == 882
    assert 0.10 < n_test / task.num_problems < 0.20
    # distinct while there are enough, then every problem again (sampling with replacement, evenly)
    train = task.examples("train", 2 * n_train + 5)
    assert len(set(train[:n_train])) == n_train
    assert set(train[n_train : 2 * n_train]) == set(train[:n_train])


def test_empty_split_raises_clear_error() -> None:
    task = ArithmeticTask(max_operand=1, operators=("*",))  # 0*0, 0*1, 1*0, 1*1: all four hash to train
    train = task.examples("train", 10)
    assert len(set(train)) == 4 and len(train) == 10  # too few for 10 distinct: repeats, no error
    with pytest.raises(ValueError, match="the test split .* is empty"):
        task.examples("test", 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_operand": 0}, "max_operand"),
        ({"num_operands": 1}, "num_operands"),
        ({"operators": ("/",)}, "operators"),
        ({"operators": ()}, "operators"),
        ({"operators": ("+", "+")}, "operators"),
        ({"max_operand": 10**9, "num_operands": 60, "operators": ("*",)}, "characters"),
    ],
)
def test_bad_config_is_rejected(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(**kwargs)  # type: ignore[arg-type]


def test_bad_split_or_n_is_rejected() -> None:
    with pytest.raises(ValueError, match="split"):
        ArithmeticTask().examples("valid", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be"):
        ArithmeticTask().examples("train", -1)


def test_tasks_do_not_import_torch() -> None:
    code = "import sys, fp8rl.tasks; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- extraction and reward ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("#### 42", "42"),
        ("She has 3 + 4 = 7 left.\n#### 1,234,567", "1234567"),
        ("####   -12  \n", "-12"),
        ("#### - 5", "-5"),
        ("#### +8", "8"),
        ("#### 1 234", "1234"),
        ("#### 72.0", "72"),
        ("#### 72.", "72"),
        ("#### 0.50", "0.5"),
        ("#### -0", "0"),
        ("#### 007", "7"),
        ("#### 3\nsecond try\n#### 4", "4"),
        ("#### 5 apples\nthat's it", "5 apples"),
        ("#### 12,34", "12,34"),
        ("The answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{{a}{b{c}}}", "{a}{b{c}}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{ 3,000 }", "3000"),
        ("#### 5\nno, \\boxed{6}", "6"),
        ("\\boxed{6}\n#### 5", "5"),
        ("\\boxed{7} and then \\boxed{8", None),
        ("#### 9\nthen \\boxed{8", "9"),
        ("42", "42"),
        ("  -17\n", "-17"),
        ("+3.0", "3"),
        ("1,000", "1000"),
        ("", None),
        ("   ", None),
        ("####", None),
        ("#### \nmore", None),
        ("\\boxed{}", None),
        ("the answer is 42", None),
        ("42 apples", None),
        ("1 2", None),
        ("4-2", None),
    ],
)
def test_extract_answer(response: str, expected: str | None) -> None:
    assert extract_answer(response) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("  1,234.500 ", "1234.5"),
        ("-0.0", "0"),
        (".5", "0.5"),
        ("-.5", "-0.5"),
        ("+0", "0"),
        ("1e3", "1e3"),
        ("3/4", "3/4"),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("19", "19", 1.0),
        ("19", "20", 0.0),
        ("-4", "-4", 1.0),
        ("4", "-4", 0.0),
        ("#### 1,234", "1234", 1.0),
        ("\\boxed{1234.0}", "1,234", 1.0),
        ("19 ", " 19", 1.0),
        ("nineteen", "19", 0.0),
        ("", "19", 0.0),
        ("", "", 0.0),  # an empty reference is never matched
        ("#### 3\n#### 19", "19", 1.0),
        ("#### 19\n#### 3", "19", 0.0),
    ],
)
def test_exact_match_reward(response: str, answer: str, reward: float) -> None:
    assert exact_match_reward(response, answer) == reward


def test_reward_is_one_for_the_task_answer_and_zero_for_a_neighbour() -> None:
    for ex in TASKS[1].examples("train", 200):
        assert exact_match_reward(ex.answer, ex.answer) == 1.0
        assert exact_match_reward(str(int(ex.answer) + 1), ex.answer) == 0.0


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_normalize_answer_is_idempotent(s: str) -> None:
    once = normalize_answer(s)
    assert normalize_answer(once) == once


@settings(max_examples=300, deadline=None)
@given(st.from_regex(r"\A[+-]? ?([0-9]{1,3}(,[0-9]{3}){0,3}|[0-9]{4,9})(\.[0-9]{0,3})?\Z"))
def test_normalize_answer_is_idempotent_on_numbers(s: str) -> None:
    once = normalize_answer(s)
    assert normalize_answer(once) == once
    assert re.fullmatch(r"-?(0|[1-9][0-9]*)(\.[0-9]*[1-9])?", once), (s, once)


@settings(max_examples=300, deadline=None)
@given(st.integers())
def test_gsm8k_marker_gives_the_integer(n: int) -> None:
    assert extract_answer(f"#### {n}") == str(n)
    assert extract_answer(f"work...\n#### {n:,}\n") == str(n)
    assert extract_answer(f"\\boxed{{{n}}}") == str(n)
    assert extract_answer(str(n)) == str(n)


# --- JSONL -------------------------------------------------------------------------------------


def test_jsonl_round_trip(tmp_path: Path) -> None:
    examples = [
        *TASKS[1].examples("train", 50),
        Example(prompt='Q: say "hi"\n\\ A:', answer="\\frac{1}{2}"),
        Example(prompt="caf\u00e9?", answer="-3.5"),
    ]
    path = tmp_path / "sub" / "data.jsonl"
    write_jsonl(path, examples)
    assert load_jsonl(path) == examples
    assert [p.name for p in path.parent.iterdir()] == ["data.jsonl"]  # no temporary left behind
    write_jsonl(path, examples[:2], prompt_key="question", answer_key="solution")  # replaces the file
    assert load_jsonl(path, prompt_key="question", answer_key="solution") == examples[:2]


def test_load_jsonl_extracts_final_answers_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "gsm.jsonl"
    rows = [
        {"question": "Natalia sold 48 clips...", "answer": "She sold 48/2 = <<48/2=24>>24.\n#### 1,072", "id": 1},
        {"question": "q2", "answer": "so \\boxed{\\frac{3}{4}}"},
        {"question": "q3", "answer": " +5.0 "},
        {"question": "q4", "answer": "Paris"},
    ]
    path.write_text(
        "\n".join(json.dumps(r) for r in rows[:2]) + "\n\n   \n" + "\r\n".join(json.dumps(r) for r in rows[2:])
    )
    assert load_jsonl(path, prompt_key="question") == [
        Example("Natalia sold 48 clips...", "1072"),
        Example("q2", "\\frac{3}{4}"),
        Example("q3", "5"),
        Example("q4", "Paris"),
    ]


def test_load_jsonl_alphabet_check(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\u00e9", "answer": "2"}\n', encoding="utf-8")
    assert len(load_jsonl(path)) == 2
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))}:2: characters outside.*'\u00e9'"):
        load_jsonl(path, alphabet=CHAR_VOCAB)


GOOD = '{"prompt": "1+1=", "answer": "2"}'


@pytest.mark.parametrize(
    ("content", "bad_line", "match"),
    [
        (f"{GOOD}\n{{not json\n", 2, "invalid JSON"),
        (f"{GOOD}\n\n{GOOD[:-1]}\n", 3, "invalid JSON"),
        (f'{GOOD}\n{{"prompt": "x"}}\n', 2, "missing key 'answer'"),
        (f'{{"answer": "x"}}\n{GOOD}\n', 1, "missing key 'prompt'"),
        (f'{GOOD}\n{{"prompt": "x", "answer": 42}}\n', 2, "'answer' must be a string, got int"),
        ('{"prompt": null, "answer": "1"}\n', 1, "'prompt' must be a string, got NoneType"),
        (f"{GOOD}\n[1, 2]\n", 2, "expected a JSON object, got list"),
        (f'{GOOD}\n{GOOD}\n{{"prompt": "x", "answer": "#### "}}\n', 3, "answer has .* but no final answer"),
        ('{"prompt": "x", "answer": "\\\\boxed{3"}\n', 1, "answer has .* but no final answer"),
        ('{"prompt": "x", "answer": "  "}\n', 1, "answer is empty"),
        ('{"prompt": "", "answer": "1"}\n', 1, "'prompt' is empty"),
    ],
)
def test_load_jsonl_errors_name_file_and_line(tmp_path: Path, content: str, bad_line: int, match: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}:{bad_line}: {match}") as info:
        load_jsonl(path)
    assert isinstance(info.value, UserError)


def test_load_jsonl_non_utf8_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD.encode() + b'\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}:2: not UTF-8"):
        load_jsonl(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_load_jsonl_empty_file_names_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}: no examples"):
        load_jsonl(path)


def test_load_jsonl_missing_file_or_directory_names_file(tmp_path: Path) -> None:
    for path in (tmp_path / "nope.jsonl", tmp_path):
        with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}: cannot read"):
            load_jsonl(path)
