"""The task (prompts and answers) and the reward that scores the responses."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from fp8rl.config.base import Strict
from fp8rl.tasks.word_problems import MAX_DIFFICULTY


class _PromptOptions(Strict):
    # auto: the tokenizer's chat template when it has one; always: it or an error; never: raw text
    # (fp8rl.tasks.prompts)
    chat_template: Literal["auto", "always", "never"] = "auto"
    system_prompt: str | None = None


class ArithmeticTaskConfig(_PromptOptions):
    """The built-in synthetic task (``fp8rl.tasks.ArithmeticTask``)."""

    type: Literal["arithmetic"] = "arithmetic"
    max_operand: int = Field(20, ge=1)
    operators: tuple[Literal["+", "-", "*"], ...] = ("+", "-")
    num_operands: int = Field(2, ge=2)


class WordProblemsTaskConfig(_PromptOptions):
    """Built-in multi-step arithmetic word problems (``fp8rl.tasks.word_problems``): ``difficulty`` 1..6, a
    training pool of ``train_size`` problems; the held-out set is the run's ``eval_examples`` test problems. ``seed``
    picks the problems (the same for every run seed, so all runs are evaluated on the same held-out set)."""

    type: Literal["word-problems"]
    difficulty: int = Field(3, ge=1, le=MAX_DIFFICULTY)
    seed: int = 0
    train_size: int = Field(20_000, ge=1)


class TaskFields(Strict):
    """Column names of a record's prompt, answer and chat messages (GSM8K: ``prompt: question``)."""

    prompt: str = "prompt"
    answer: str = "answer"
    messages: str = "messages"


class JsonlTaskConfig(_PromptOptions):
    """Users' own data: JSON Lines (``type: jsonl``) or Parquet (``type: parquet``) files of records
    ``{"prompt" | "messages", "answer", ...}`` (``fp8rl.tasks.load_examples``)."""

    type: Literal["jsonl", "parquet"]
    train: str
    test: str
    fields: TaskFields = TaskFields()


class ExactMatchRewardConfig(Strict):
    """1.0 when the answer extracted from the response equals the reference (``fp8rl.tasks.rewards``)."""

    type: Literal["exact-match"] = "exact-match"
    extract: Literal["strict", "last-number", "boxed", "gsm8k"] = "strict"


class PythonRewardConfig(Strict):
    """``name(response, answer, example) -> float`` from ``function: "path/to/file.py:name"``."""

    type: Literal["python"]
    function: str = Field(pattern=r"^.+\.py:[A-Za-z_][A-Za-z0-9_]*$")
    timeout_s: float = Field(10.0, gt=0)
    workers: int = Field(4, ge=1)


RewardConfig = Annotated[ExactMatchRewardConfig | PythonRewardConfig, Field(discriminator="type")]


TaskConfig = Annotated[ArithmeticTaskConfig | JsonlTaskConfig | WordProblemsTaskConfig, Field(discriminator="type")]
