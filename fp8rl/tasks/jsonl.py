"""Users' own verifiable data: JSON Lines or Parquet records, one problem each.

A record is ``{"prompt": str, "answer": str}`` or ``{"messages": [{"role", "content"}, ...], "answer": str}``
(a chat; ``prompt`` is then its last user turn), plus any other fields, which reach a Python reward as
``example``.  ``fields`` maps other column names onto these (GSM8K: ``{"prompt": "question"}``).

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
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

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


def _string(record: Mapping[str, Any], key: str, where: str) -> str:
    if key not in record:
        raise DatasetError(f"{where}: missing key {key!r} (keys: {sorted(record)})")
    if not isinstance(record[key], str):
        raise DatasetError(f'{where}: {key!r} must be a string, got {type(record[key]).__name__} (write 42 as "42")')
    return str(record[key])


def _messages(raw: Any, key: str, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, list) or not raw:
        raise DatasetError(f"{where}: {key!r} must be a non-empty list of {{'role', 'content'}} objects")
    turns = []
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: {key}[{i}] must be an object with string 'role' and 'content'")
        if m["role"] not in ("system", "user", "assistant"):
            raise DatasetError(f"{where}: {key}[{i}].role must be system, user or assistant, got {m['role']!r}")
        turns.append((m["role"], m["content"]))
    if turns[-1][0] != "user":
        raise DatasetError(f"{where}: the last of {key!r} must be a user turn (the model answers it)")
    return tuple(turns)


def parse_record(record: Any, where: str, fields: Mapping[str, str] | None = None) -> Example:
    """One record -> ``Example`` (``fields`` maps ``prompt`` / ``answer`` / ``messages`` to column names)."""
    f = {"prompt": "prompt", "answer": "answer", "messages": "messages", **(fields or {})}
    if not isinstance(record, Mapping):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    messages = None
    if record.get(f["messages"]) is not None and f["prompt"] not in record:
        messages = _messages(record[f["messages"]], f["messages"], where)
        prompt = messages[-1][1]
    else:
        prompt = _string(record, f["prompt"], where)
    raw_answer = _string(record, f["answer"], where)
    if not prompt:
        raise DatasetError(f"{where}: {f['prompt']!r} is empty")
    extra = {k: v for k, v in record.items() if k not in (f["prompt"], f["answer"], f["messages"])}
    return Example(prompt=prompt, answer=_reference_answer(raw_answer, where), messages=messages, extra=extra)


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
    except ImportError:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses for unreadable files
        raise DatasetError(f"{path}: not a readable Parquet file ({e})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}: row {i}", row


def load_examples(
    path: str | os.PathLike[str], fields: Mapping[str, str] | None = None, fmt: str = "auto"
) -> list[Example]:
    """Examples from a JSON Lines (``.jsonl``/``.json``) or Parquet (``.parquet``) file; ``fmt`` forces one."""
    path = Path(path)
    kind = fmt if fmt != "auto" else ("parquet" if path.suffix == ".parquet" else "jsonl")
    if kind == "jsonl":
        f = {"prompt": "prompt", "answer": "answer", **(fields or {})}
        return load_jsonl(path, f["prompt"], f["answer"], fields=fields)
    if not path.is_file():
        raise DatasetError(f"{path}: cannot read (no such file)")
    examples = [parse_record(row, where, fields) for where, row in _parquet_records(path)]
    if not examples:
        raise DatasetError(f"{path}: no examples (the file has no rows)")
    return examples


def load_jsonl(
    path: str | os.PathLike[str],
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    *,
    alphabet: Iterable[str] | None = None,
    fields: Mapping[str, str] | None = None,
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
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
                example = parse_record(record, where, {**(fields or {}), "prompt": prompt_key, "answer": answer_key})
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
