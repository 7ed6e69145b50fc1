"""The word-problem task: exact answers (against an independent reading of the text), seeded disjoint splits,
difficulty, the answer extraction its reward uses, and its place in the run config."""

from __future__ import annotations

import re

import pytest

from fp8rl.config import ConfigError, load_recipe, parse_run_config
from fp8rl.tasks import Example
from fp8rl.tasks.rewards import ExactMatch
from fp8rl.tasks.word_problems import LEVELS, MAX_DIFFICULTY, WordProblemTask, is_test_problem

_NUM = r"([0-9]+)"


def reference_answer(prompt: str) -> int:
    """The answer read back from the text alone, sentence by sentence (independent of the generator's code)."""
    sentences = re.split(r"(?<=\.)\s+", prompt)
    total = int(re.fullmatch(rf"\w+ has {_NUM} \w+\.", sentences[0]).group(1))  # type: ignore[union-attr]
    for s in sentences[1:]:
        if s.startswith("How many"):
            break
        if m := re.search(rf"(?:buys|gets) {_NUM} \w+ (?:of|with) {_NUM} \w+ (?:each|in each)\.$", s):
            total += int(m.group(1)) * int(m.group(2))
        elif m := re.search(rf"(?:buys|finds) {_NUM} more|gives (?:him|her) {_NUM}", s):
            total += int(m.group(1) or m.group(2))
        elif m := re.search(rf"(?:gives|sells|loses) {_NUM}", s):
            total -= int(m.group(1))
        else:
            raise AssertionError(f"unread sentence {s!r}")
    return total


@pytest.mark.parametrize("difficulty", sorted(LEVELS))
def test_every_answer_is_what_the_text_says(difficulty: int) -> None:
    examples = WordProblemTask(difficulty).examples("train", 300)
    for e in examples:
        assert int(e.answer) == reference_answer(e.prompt), e.prompt
        assert int(e.answer) >= 0  # nothing is ever taken away below zero


def test_splits_are_disjoint_seeded_and_deterministic() -> None:
    task = WordProblemTask(difficulty=3, seed=0)
    train, test = task.examples("train", 20_000), task.examples("test", 500)
    assert len({e.prompt for e in test}) == 500 and len({e.prompt for e in train}) == 20_000
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    assert all(is_test_problem(e.prompt) for e in test) and not any(is_test_problem(e.prompt) for e in train)
    assert task.examples("test", 500) == test  # the same problems on every call (and machine)
    assert task.examples("test", 100) == test[:100]
    other = WordProblemTask(difficulty=3, seed=1).examples("test", 500)
    assert other != test and all(is_test_problem(e.prompt) for e in other)  # another seed, other problems


def test_difficulty_sets_steps_and_number_range() -> None:
    sizes = []
    for d, level in LEVELS.items():
        examples = WordProblemTask(d).examples("test", 200)
        steps = [e.prompt.count(" Then ") for e in examples]
        assert set(steps) == {level.steps}
        starts = [int(re.match(rf"\w+ has {_NUM}", e.prompt).group(1)) for e in examples]  # type: ignore[union-attr]
        assert level.low <= min(starts) and max(starts) <= level.high
        sizes.append(sum(int(e.answer) for e in examples) / len(examples))
    assert sizes[0] < sizes[1] and sizes[2] < sizes[3] < sizes[4] < sizes[5]  # harder levels, larger answers
    assert any(" each." in e.prompt for e in WordProblemTask(5).examples("test", 100))  # products from level 4 up
    assert not any(" each." in e.prompt for e in WordProblemTask(3).examples("test", 200))


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="difficulty"):
        WordProblemTask(difficulty=MAX_DIFFICULTY + 1)
    with pytest.raises(ValueError, match="split"):
        WordProblemTask().examples("valid", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be"):
        WordProblemTask().examples("test", -1)


def test_the_last_number_and_gsm8k_rules_read_the_final_answer() -> None:
    example = Example(prompt="Ava has 14 pencils. ...", answer="1212")
    last, gsm8k = ExactMatch("last-number"), ExactMatch("gsm8k")
    responses = [
        "Ava has 14 + 5 = 19 pencils, then 19 * 63 + 15 = 1212. The answer is 1212.",  # last number: right
        "So she has 1,212 pencils.",  # thousands separator
        "The answer is 1212. Wait, 14 + 5 = 19.",  # the last number is not the answer
        "She has 14 + 5 = 19.\n#### 1212",  # GSM8K marker
        "I cannot tell.",
    ]
    assert last.score(responses, [example] * 5).rewards == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert gsm8k.score(responses, [example] * 5).rewards == [0.0, 0.0, 0.0, 1.0, 0.0]


def _run_config(task: dict[str, object], eval_examples: int = 500) -> object:
    data = {"recipe": load_recipe("bf16").model_dump(), "task": task, "eval_examples": eval_examples}
    return parse_run_config(data, "test.yaml")


def test_the_run_config_serves_the_task_through_the_loop() -> None:
    from fp8rl.build import task_examples

    cfg = _run_config({"type": "word-problems", "difficulty": 2, "train_size": 2_000})
    train, heldout = task_examples(cfg)  # type: ignore[arg-type]
    assert len(train) == 2_000 and len(heldout) == 500
    assert not {e.prompt for e in train} & {e.prompt for e in heldout}
    assert heldout == WordProblemTask(2).examples("test", 500)
    with pytest.raises(ConfigError, match=r"task\.word-problems\.difficulty"):
        _run_config({"type": "word-problems", "difficulty": 0})
