"""Users' own verifiable data as JSON Lines: one ``{"prompt": ..., "answer": ...}`` object per line.

Answers are stored normalised (``normalize_answer``).  An answer written GSM8K
style, with its working (``"... <<48/2=24>>24 ... #### 72"``), or as
``\\boxed{72}``, is reduced to the final answer the same way a response is
(``extract_answer``), so the reward compares like with like.

Every error is a ``DatasetError`` that starts ``<file>:<line>:`` where a line is
to blame, so an editor can jump to it.  Blank lines are skipped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from fp8rl.atomic import atomic_write_text
from fp8rl.errors import UserError
from fp8rl.tasks.verify import BOXED_MARKER, GSM8K_MARKER, Example, extract_answer, normalize_answer


class DatasetError(UserError):
    """A dataset file that cannot be read as examples; the message names the file and line."""


def _reference_answer(raw: str, where: str) -> str:
    if GSM8K_MARKER in raw or BOXED_MARKER in raw:
        answer = extract_answer(raw)
        if answer is None:
            raise DatasetError(f"{where}: answer has {GSM8K_MARKER!r} or {BOXED_MARKER!r} but no final answer in it")
        return answer
    answer = normalize_answer(raw)
    if not answer:
        raise DatasetError(f"{where}: answer is empty")
    return answer


def _parse_line(line: str, where: str, prompt_key: str, answer_key: str) -> Example:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    values = []
    for key in (prompt_key, answer_key):
        if key not in record:
            raise DatasetError(f"{where}: missing key {key!r} (keys: {sorted(record)})")
        if not isinstance(record[key], str):
            raise DatasetError(
                f'{where}: {key!r} must be a string, got {type(record[key]).__name__} (write 42 as "42")'
            )
        values.append(record[key])
    prompt, raw_answer = values
    if not prompt:
        raise DatasetError(f"{where}: {prompt_key!r} is empty")
    return Example(prompt=prompt, answer=_reference_answer(raw_answer, where))


def load_jsonl(
    path: str | os.PathLike[str],
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    *,
    alphabet: Iterable[str] | None = None,
) -> list[Example]:
    """Examples from a UTF-8 JSON Lines file, answers normalised (see the module docstring).

    With ``alphabet`` (e.g. the char tokenizer's ``CHAR_VOCAB``), a prompt or answer
    holding any other character is an error rather than silently unknown tokens.
    """
    path = Path(path)
    allowed = None if alphabet is None else frozenset(alphabet)
    examples = []
    try:
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8").removeprefix("\ufeff")  # tolerate a byte-order mark
                except UnicodeDecodeError as e:
                    raise DatasetError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
                if not line.strip():
                    continue
                example = _parse_line(line, where, prompt_key, answer_key)
                if allowed is not None:
                    bad = sorted(set(example.prompt + example.answer) - allowed)
                    if bad:
                        raise DatasetError(f"{where}: characters outside the model's vocabulary: {bad}")
                examples.append(example)
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror or e})") from None
    if not examples:
        raise DatasetError(f"{path}: no examples (the file is empty or has only blank lines)")
    return examples


def write_jsonl(
    path: str | os.PathLike[str],
    examples: Iterable[Example],
    prompt_key: str = "prompt",
    answer_key: str = "answer",
) -> None:
    """Write ``examples`` one JSON object a line, atomically: a temporary file in the same directory, then a rename."""
    lines = [json.dumps({prompt_key: ex.prompt, answer_key: ex.answer}) + "\n" for ex in examples]
    # json.dumps escapes non-ASCII, so the file is ASCII (hence UTF-8) whatever the locale's encoding.
    atomic_write_text(path, "".join(lines))
