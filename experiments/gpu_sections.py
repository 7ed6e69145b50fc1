"""What the GPU check scripts share: run one section, record ok or failed (never swallowed), write the JSON.

A failed section is recorded with its error and traceback and the run goes on, so one device call
reports every section; the JSON is rewritten after each section, so a call cut short still returns
what finished.
"""

from __future__ import annotations

import json
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class SectionTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Raise ``SectionTimeout`` in the main thread after ``seconds`` (SIGALRM)."""

    def _alarm(_sig: int, _frame: Any) -> None:
        raise SectionTimeout("section time limit reached")

    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


def run_section(
    report: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]], out: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    """``report["sections"][name]`` = ``{"status": "ok", **fn(), "seconds"}`` or ``{"status": "failed", "error",
    "traceback", "seconds"}``; then ``report`` is written to ``out``."""
    t0 = time.perf_counter()
    entry: dict[str, Any]
    try:
        entry = {"status": "ok", **fn()}
    except Exception as e:  # recorded as failed in the JSON and the log; the next section runs
        entry = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
        log(entry["traceback"])
    entry["seconds"] = round(time.perf_counter() - t0, 1)
    report["sections"][name] = entry
    log(f"=== section {name}: {entry['status']} in {entry['seconds']}s ===")
    out.write_text(json.dumps(report, indent=1, default=str))
    return entry


def say(line: str) -> None:
    print(line, flush=True)


class Deadline:
    """A section's time budget: work inside it checks ``out()`` and skips what no longer fits."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()

    def out(self) -> bool:
        return self.left() <= 0


def short_error(e: BaseException) -> dict[str, str]:
    """A failure inside a section (one backend, one shape) recorded without ending the section."""
    return {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]}
