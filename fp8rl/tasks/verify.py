"""Verifiable answers: what an example holds, how an answer is read out of a response, and the reward.

Extraction (``extract_answer``), in this order:

1. Final-answer markers.  The last ``#### <answer>`` (GSM8K style; the answer is
   the rest of that line) and the last ``\\boxed{<answer>}`` (braces inside the box
   must balance, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``).  If both
   markers are present, the one that starts later in the response wins: it is the
   model's final word.  A marker with nothing after it, or a last box that never
   closes (a truncated response), counts as no marker.
2. Otherwise, if the whole stripped response is a number, that number (the
   synthetic tasks train the model to answer with just the number, then EOS).
3. Otherwise ``None``: no answer, reward 0.

Normalisation (``normalize_answer``) makes equal numbers equal strings.  A string
that, stripped of surrounding whitespace, is a decimal number is rewritten in a
canonical form:

- a leading ``+`` is dropped, as are spaces between the sign and the digits;
- thousands separators are removed: ``,`` or a space, used consistently, between
  groups of exactly three digits (``1,234,567`` and ``1 234`` are numbers;
  ``12,34`` is not, and is left as text);
- leading zeros of the integer part and trailing zeros of the fraction are
  dropped, then a bare trailing ``.`` (``42.0`` -> ``42``, ``42.`` -> ``42``,
  ``.5`` -> ``0.5``, ``007`` -> ``7``);
- negative zero is zero (``-0`` and ``-0.0`` -> ``0``).

Anything else (fractions, exponents, words) is only stripped of surrounding
whitespace and must match exactly.  ``normalize_answer`` is idempotent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GSM8K_MARKER = "####"
BOXED_MARKER = "\\boxed{"

# Digits are ASCII only: \d would also accept e.g. Arabic-Indic digits, which the
# canonical form could not strip zeros from.
_NUMBER = re.compile(
    r"(?P<sign>[+-]?)\s*"
    r"(?P<int>[0-9]{1,3}(?P<sep>[, ])[0-9]{3}(?:(?P=sep)[0-9]{3})*|[0-9]+)?"
    r"(?:\.(?P<frac>[0-9]*))?",
    re.ASCII,
)


@dataclass(frozen=True)
class Example:
    """One verifiable problem: the ``prompt`` the model continues, and the normalised reference ``answer``.

    ``messages`` (``((role, content), ...)``), when given, is the conversation a chat template renders
    instead of ``prompt`` (``prompt`` then holds its last user turn); ``extra`` holds the record's other
    fields, passed to a user's reward function.
    """

    prompt: str
    answer: str
    messages: tuple[tuple[str, str], ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)


def _canonical_number(text: str) -> str | None:
    """The canonical form of ``text`` if it is a decimal number (see the module docstring), else None."""
    m = _NUMBER.fullmatch(text)
    if m is None or (not m["int"] and not m["frac"]):
        return None
    integer = (m["int"] or "").replace(",", "").replace(" ", "").lstrip("0") or "0"
    fraction = (m["frac"] or "").rstrip("0")
    number = f"{integer}.{fraction}" if fraction else integer
    return f"-{number}" if m["sign"] == "-" and number != "0" else number


def normalize_answer(s: str) -> str:
    """Canonical form of an answer: numbers as in the module docstring, other text stripped."""
    stripped = s.strip()
    number = _canonical_number(stripped)
    return stripped if number is None else number


def _last_gsm8k(text: str) -> tuple[int, str] | None:
    start = text.rfind(GSM8K_MARKER)
    if start < 0:
        return None
    answer = normalize_answer(text[start + len(GSM8K_MARKER) :].split("\n", 1)[0])
    return (start, answer) if answer else None


def _last_boxed(text: str) -> tuple[int, str] | None:
    start = text.rfind(BOXED_MARKER)
    if start < 0:
        return None
    depth = 1
    for i in range(start + len(BOXED_MARKER), len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
        if depth == 0:
            answer = normalize_answer(text[start + len(BOXED_MARKER) : i])
            return (start, answer) if answer else None
    return None  # the box never closes: a truncated response has no boxed answer


def extract_answer(text: str) -> str | None:
    """The normalised answer in a response, or None when it gives none (rules in the module docstring)."""
    marked = [c for c in (_last_gsm8k(text), _last_boxed(text)) if c is not None]
    if marked:
        return max(marked)[1]
    return _canonical_number(text.strip())


def exact_match_reward(response: str, answer: str) -> float:
    """1.0 if the answer extracted from ``response`` equals the normalised reference ``answer``, else 0.0."""
    extracted = extract_answer(response)
    return 1.0 if extracted is not None and extracted == normalize_answer(answer) else 0.0
