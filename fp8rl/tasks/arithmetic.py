"""Synthetic integer arithmetic: a verifiable task a tiny character-level model can learn.

A problem is ``num_operands`` integers in ``[0, max_operand]`` joined by operators
from ``operators`` (``+``, ``-``, ``*``).  The prompt is the expression followed by
``=``, with no spaces, and the answer is the integer value in Python's precedence
(``*`` before ``+``/``-``, left to right), negative where ``-`` makes it so::

    Example(prompt="12+7=", answer="19")
    Example(prompt="3-4*5=", answer="-17")

The model is expected to answer with just the number, then EOS; ``sft_text`` is
the supervised target for a warm-up (prompt + answer; the tokenizer adds EOS).

Splits.  Whether a problem is a test problem depends only on a SHA-256 hash of
its expression (``TEST_PERCENT`` of problems), never on the seed, ``n`` or the
rest of the config: the same expression is in the same split for every seed and
every difficulty, so no test problem is ever trained on, even across a curriculum.
(``3+4`` and ``4+3`` are different problems and may land in different splits.)

Sampling.  Problems are visited in the order of a keyed pseudo-random permutation
of the problem space (a Feistel network, keyed by seed, split and pass), so:

- examples are distinct until the split runs out, then further passes repeat
  every problem in a fresh order (sampling with replacement, evenly);
- the first ``k`` of ``examples(split, n)`` are ``examples(split, k)``;
- the cost is O(n) even for a space of 10^30 problems, with nothing enumerated.

``examples`` raises ``ValueError`` only when the split has no problems at all
(possible for a tiny space, e.g. ``max_operand=1``).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from fp8rl.tasks.verify import Example

SUPPORTED_OPERATORS = ("+", "-", "*")
TEST_PERCENT = 15
# The tiny presets have 512 positions; leave two for BOS and EOS.
MAX_SFT_CHARS = 510

Split = Literal["train", "test"]


def is_test_problem(expression: str) -> bool:
    """Whether ``expression`` (e.g. ``"12+7"``) belongs to the test split; stable across runs and machines."""
    digest = hashlib.sha256(b"fp8rl.arithmetic.split:" + expression.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < TEST_PERCENT


def _evaluate(operands: list[int], ops: list[str]) -> int:
    """Value with ``*`` binding tighter than ``+``/``-``: a sum of signed products."""
    total, term = 0, operands[0]
    for op, x in zip(ops, operands[1:], strict=True):
        if op == "*":
            term *= x
        else:
            total += term
            term = x if op == "+" else -x
    return total + term


def _feistel(index: int, half_bits: int, key: bytes) -> int:
    """A keyed pseudo-random permutation of ``[0, 2**(2*half_bits))``: four Feistel rounds over SHA-3 (SHAKE-256)."""
    mask = (1 << half_bits) - 1
    nbytes = (half_bits + 7) // 8
    left, right = index >> half_bits, index & mask
    for round_ in range(4):
        data = key + bytes([round_]) + right.to_bytes(nbytes, "big")
        f = int.from_bytes(hashlib.shake_256(data).digest(nbytes), "big") & mask
        left, right = right, left ^ f
    return (left << half_bits) | right


@dataclass(frozen=True)
class ArithmeticTask:
    """Integer arithmetic problems; difficulty grows with ``max_operand``, ``operators`` and ``num_operands``."""

    max_operand: int = 20
    operators: tuple[str, ...] = ("+", "-")
    num_operands: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "operators", tuple(self.operators))  # a list would make the task unhashable
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        if self.num_operands < 2:
            raise ValueError(f"num_operands must be >= 2, got {self.num_operands}")
        unknown = [op for op in self.operators if op not in SUPPORTED_OPERATORS]
        if not self.operators or unknown or len(set(self.operators)) != len(self.operators):
            raise ValueError(f"operators must be distinct, non-empty, from {SUPPORTED_OPERATORS}; got {self.operators}")
        if self.max_sft_chars > MAX_SFT_CHARS:
            raise ValueError(
                f"problems with {self.num_operands} operands up to {self.max_operand} can take "
                f"{self.max_sft_chars} characters; the model fits {MAX_SFT_CHARS}"
            )

    @property
    def num_problems(self) -> int:
        """Size of the problem space, both splits together."""
        k = self.num_operands
        return (self.max_operand + 1) ** k * len(self.operators) ** (k - 1)

    @property
    def max_sft_chars(self) -> int:
        """An upper bound on ``len(sft_text(example))`` over all problems."""
        k, m = self.num_operands, self.max_operand
        prompt = k * len(str(m)) + (k - 1) + 1
        # With m >= 2, a + b <= a * b for a, b >= 2, so a sum of products of k operands is at most m**k.
        largest = max(m, 2) ** k if "*" in self.operators else k * m
        return prompt + len(str(largest)) + 1  # + 1 for a minus sign

    def problem(self, index: int) -> Example:
        """Problem number ``index`` in ``[0, num_problems)``: operands, then operators, as mixed-radix digits."""
        operands, ops = [], []
        for _ in range(self.num_operands):
            index, digit = divmod(index, self.max_operand + 1)
            operands.append(digit)
        for _ in range(self.num_operands - 1):
            index, digit = divmod(index, len(self.operators))
            ops.append(self.operators[digit])
        expression = "".join(str(x) + op for x, op in zip(operands, [*ops, ""], strict=True))
        return Example(prompt=expression + "=", answer=str(_evaluate(operands, ops)))

    def _stream(self, split: Split) -> Iterator[Example]:
        """Every problem of ``split`` in pseudo-random order, pass after pass, forever."""
        size = self.num_problems
        half_bits = max(1, ((size - 1).bit_length() + 1) // 2)
        for pass_ in itertools.count():
            key = f"fp8rl.arithmetic:{self.seed}:{split}:{pass_}".encode()
            found = False
            for i in range(1 << (2 * half_bits)):
                index = _feistel(i, half_bits, key)
                if index >= size:  # the permutation's domain is a power of two; skip what lies outside
                    continue
                example = self.problem(index)
                if is_test_problem(example.prompt[:-1]) == (split == "test"):
                    found = True
                    yield example
            if not found:
                raise ValueError(
                    f"the {split} split of {self} is empty: all {size} problems hash to the other split; "
                    "raise max_operand or add operators"
                )

    def examples(self, split: Split, n: int) -> list[Example]:
        """``n`` examples of ``split``, deterministic in the seed; distinct while the split has enough problems."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return list(itertools.islice(self._stream(split), n))

    @staticmethod
    def sft_text(example: Example) -> str:
        """The supervised target for a warm-up: the prompt followed by the answer (EOS is the tokenizer's)."""
        return example.prompt + example.answer
