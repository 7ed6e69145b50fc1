"""Multi-step arithmetic word problems with exact integer answers: a held-out task with headroom for real models.

A problem is a short story about one person's stock of items, changed by ``operations`` steps, then a question::

    Mia has 47 stickers. She buys 3 packs of 12 stickers each. Then she gives 25 stickers to her brother.
    How many stickers does Mia have now? Give the final answer as a number.
    -> answer "58"  (47 + 3 * 12 - 25)

Each step adds (``+``: "finds 15 more"), takes away (``-``: "gives 25 to her brother"; never below zero) or adds
a product (``*``: "buys 3 packs of 12 each": a count of 2..9 times a size). The answer is read from a response
by the reward's extraction rule (``last-number``, lm-eval's GSM8K flexible extract, or ``gsm8k``'s ``#### N``).

Difficulty (``LEVELS``) sets the number of steps, the range of the numbers and the operations: level 1 is one
addition or subtraction of numbers up to 20, level 5 two steps with three-digit numbers and products (the
GSM8K-like setting), level 6 three such steps.

Splits.  Whether a problem is a test problem depends only on a SHA-256 hash of its text (``TEST_PERCENT`` of
problems), never on the seed or the level, so no test problem is ever trained on.  Each split is drawn from a
``random.Random`` keyed by (seed, split, level), skipping problems of the other split and repeats, so both are
deterministic, distinct and, by the hash, disjoint.  Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Literal

from fp8rl.tasks.verify import Example

TEST_PERCENT = 20
QUESTION_SUFFIX = "Give the final answer as a number."
Split = Literal["train", "test"]


@dataclass(frozen=True)
class Level:
    """One difficulty: ``steps`` operations on numbers in ``[low, high]`` drawn from ``operators``."""

    steps: int
    low: int
    high: int
    operators: tuple[str, ...]


LEVELS: dict[int, Level] = {
    1: Level(1, 2, 20, ("+", "-")),
    2: Level(1, 10, 99, ("+", "-")),
    3: Level(2, 2, 20, ("+", "-")),
    4: Level(2, 10, 99, ("+", "-", "*")),
    5: Level(2, 100, 999, ("+", "-", "*")),
    6: Level(3, 100, 999, ("+", "-", "*")),
}
MAX_DIFFICULTY = max(LEVELS)

_PEOPLE = (
    ("Mia", "she", "her"), ("Liam", "he", "his"), ("Ava", "she", "her"), ("Noah", "he", "his"),
    ("Zoe", "she", "her"), ("Omar", "he", "his"), ("Lena", "she", "her"), ("Ravi", "he", "his"),
    ("Sara", "she", "her"), ("Tom", "he", "his"), ("Yuki", "she", "her"), ("Ben", "he", "his"),
)  # fmt: skip
_ITEMS = (
    "apples", "stickers", "marbles", "coins", "books", "pencils", "cookies", "stamps", "shells", "cards",
    "beads", "candles",
)  # fmt: skip
_CONTAINERS = ("boxes", "bags", "packs", "jars", "crates")
_ADD = ("{P} buys {n} more {items}.", "{P} finds {n} more {items}.", "A friend gives {obj} {n} {items}.")
_SUB = ("{P} gives {n} {items} to {pos} brother.", "{P} sells {n} {items}.", "{P} loses {n} {items}.")
_MUL = ("{P} buys {k} {box} of {n} {items} each.", "{P} gets {k} {box} with {n} {items} in each.")


def is_test_problem(text: str) -> bool:
    """Whether the problem ``text`` (its prompt) belongs to the test split; stable across runs and machines."""
    digest = hashlib.sha256(b"fp8rl.word_problems.split:" + text.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < TEST_PERCENT


def _then(template: str, person: tuple[str, str, str], **numbers: object) -> str:
    """A later step of the story: ``Then she buys 12 more apples.``"""
    _, subject, possessive = person
    text = template.format(P=subject, obj="him" if subject == "he" else "her", pos=possessive, **numbers)
    return "Then " + text[0].lower() + text[1:]


def _problem(rng: random.Random, level: Level) -> Example:
    """One problem of ``level`` drawn from ``rng`` (module docstring)."""
    person, items = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    total = rng.randint(level.low, level.high)
    sentences = [f"{person[0]} has {total} {items}."]
    for _ in range(level.steps):
        op = rng.choice(level.operators)
        if op == "-" and total < level.low:
            op = "+"  # nothing left to take away
        if op == "+":
            n = rng.randint(level.low, level.high)
            sentences.append(_then(rng.choice(_ADD), person, n=n, items=items))
            total += n
        elif op == "-":
            n = rng.randint(level.low, min(level.high, total))
            sentences.append(_then(rng.choice(_SUB), person, n=n, items=items))
            total -= n
        else:
            k, n, box = rng.randint(2, 9), rng.randint(level.low, level.high), rng.choice(_CONTAINERS)
            sentences.append(_then(rng.choice(_MUL), person, k=k, n=n, box=box, items=items))
            total += k * n
    question = f"How many {items} does {person[0]} have now? {QUESTION_SUFFIX}"
    return Example(prompt=" ".join([*sentences, question]), answer=str(total))


@dataclass(frozen=True)
class WordProblemTask:
    """Arithmetic word problems of one ``difficulty`` (``LEVELS``); ``seed`` picks which problems are drawn."""

    difficulty: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.difficulty not in LEVELS:
            raise ValueError(f"difficulty must be one of {sorted(LEVELS)}, got {self.difficulty}")

    @property
    def level(self) -> Level:
        return LEVELS[self.difficulty]

    def examples(self, split: Split, n: int) -> list[Example]:
        """``n`` distinct problems of ``split``, the same for the same (seed, difficulty) on every machine."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = random.Random(f"fp8rl.word_problems:{self.seed}:{split}:{self.difficulty}")
        seen: set[str] = set()
        out: list[Example] = []
        attempts, limit = 0, 50 * n + 1000  # the smallest level has ~10^5 problems: far more than any split asks
        while len(out) < n:
            attempts += 1
            if attempts > limit:
                raise ValueError(f"difficulty {self.difficulty} has too few distinct {split} problems for n={n}")
            example = _problem(rng, self.level)
            if example.prompt in seen or is_test_problem(example.prompt) != (split == "test"):
                continue
            seen.add(example.prompt)
            out.append(example)
        return out
