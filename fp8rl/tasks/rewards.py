"""Rewards: exact match with a choice of answer extraction, or a Python function the user writes.

``reward: {type: exact-match, extract: strict | last-number | boxed | gsm8k}``
    strict       ``fp8rl.tasks.verify.extract_answer``: the last ``#### N`` / ``\\boxed{N}``, else a
                 response that is a bare number (the synthetic tasks' format; the default);
    last-number  the last number anywhere in the response (lm-eval's "flexible extract"), so
                 "1 + 4 = 5." scores against 5;
    boxed        the last ``\\boxed{...}`` only;
    gsm8k        the last ``#### ...`` only.
    The extracted answer is normalised as the reference is (``normalize_answer``) and compared exactly.

``reward: {type: python, function: "path/to/file.py:name", timeout_s: 10}``
    ``name(response: str, answer: str, example: dict) -> float`` from that file, loaded once;
    ``example`` holds the record's fields (``prompt``, ``answer``, ``messages`` and any others).
    Calls run on worker threads (``workers``), ``timeout_s`` per call: one that raises, returns a non-number or a non-finite value, or
    takes longer than ``timeout_s`` scores 0.0 and is counted (``reward/errors``,
    ``reward/timeouts``) and the first message of each step is logged; the step goes on.  (A call
    past its timeout cannot be killed from Python: its thread runs on in the background.  The threads
    are daemon threads, not a ``ThreadPoolExecutor``'s, which the interpreter joins at exit: a call
    that never returns does not keep the process, and its pod, from ending.)
"""

from __future__ import annotations

import importlib.util
import math
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from fp8rl.errors import UserError
from fp8rl.tasks.verify import Example, _canonical_number, _last_boxed, _last_gsm8k, extract_answer, normalize_answer

Extract = Literal["strict", "last-number", "boxed", "gsm8k"]

# A number as people write it in text: optional sign, digits with optional thousands commas, optional fraction.
_ANY_NUMBER = re.compile(r"[+-]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|[+-]?\.[0-9]+", re.ASCII)


class RewardError(UserError):
    """A reward function that cannot be loaded (file, function name, signature)."""


def extract_last_number(text: str) -> str | None:
    """The last number in ``text``, normalised (``"so 1,234.50 apples."`` -> ``"1234.5"``), or None."""
    found = _ANY_NUMBER.findall(text)
    return _canonical_number(found[-1]) if found else None


def _marker(fn: Callable[[str], tuple[int, str] | None]) -> Callable[[str], str | None]:
    def extract(text: str) -> str | None:
        hit = fn(text)
        return None if hit is None else hit[1]

    return extract


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "strict": extract_answer,
    "last-number": extract_last_number,
    "boxed": _marker(_last_boxed),
    "gsm8k": _marker(_last_gsm8k),
}


def example_dict(example: Example) -> dict[str, Any]:
    """The record a Python reward sees: its other fields, then prompt, answer and messages."""
    out = dict(example.extra)
    out.update(prompt=example.prompt, answer=example.answer)
    if example.messages:
        out["messages"] = [{"role": r, "content": c} for r, c in example.messages]
    return out


@dataclass
class RewardBatch:
    rewards: list[float]
    errors: int = 0
    timeouts: int = 0
    first_error: str | None = None

    def metrics(self) -> dict[str, float]:
        return {"reward/errors": float(self.errors), "reward/timeouts": float(self.timeouts)}


@dataclass(frozen=True)
class ExactMatch:
    extract: Extract = "strict"

    def score(self, responses: Sequence[str], examples: Sequence[Example]) -> RewardBatch:
        fn = EXTRACTORS[self.extract]
        out = []
        for text, ex in zip(responses, examples, strict=True):
            got = fn(text)
            out.append(1.0 if got is not None and got == normalize_answer(ex.answer) else 0.0)
        return RewardBatch(out)


def load_reward_function(spec: str, base_dir: str | Path | None = None) -> Callable[..., Any]:
    """The function named by ``"path/to/file.py:name"`` (a relative path is taken from ``base_dir`` or the cwd)."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name.isidentifier():
        raise RewardError(f"reward.function: expected 'path/to/file.py:function_name', got {spec!r}")
    path = Path(path_text)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise RewardError(f"reward.function: {path} does not exist")
    module_name = f"fp8rl_user_reward_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise RewardError(f"reward.function: {path} cannot be imported as Python")
    module = importlib.util.module_from_spec(loader_spec)
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:  # the user's module failed to import: name the file and the error
        raise RewardError(f"reward.function: importing {path} failed: {type(e).__name__}: {e}") from e
    sys.modules[module_name] = module
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"reward.function: {path} has no function {name!r}")
    return fn


class DaemonWorkers:
    """``workers`` daemon threads running submitted calls, each giving a ``Future``.  Unlike a
    ``ThreadPoolExecutor`` (whose threads the interpreter joins at exit, so one call that never returns hangs
    the process's exit), nothing waits for them: ``shutdown`` lets the idle ones end and abandons busy ones."""

    def __init__(self, workers: int, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while (item := self._calls.get()) is not None:
            fut, call = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(call())
            except BaseException as e:  # handed to the caller through the future, as an executor does
                fut.set_exception(e)

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        self._calls.put((fut, call))
        return fut

    def shutdown(self) -> None:
        """Cancel the calls not started; each idle thread ends, a busy one when (if ever) its call returns."""
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._calls.put(None)


@dataclass
class PythonReward:
    """A user's reward function (module docstring), called with a timeout on worker threads."""

    function: Callable[..., Any]
    name: str
    timeout_s: float = 10.0
    workers: int = 4
    _pool: DaemonWorkers | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _executor(self) -> DaemonWorkers:
        with self._lock:
            if self._pool is None:
                self._pool = DaemonWorkers(self.workers, "fp8rl-reward")
            return self._pool

    def _call(self, response: str, example: Example) -> float:
        value = self.function(response, example.answer, example_dict(example))
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"returned {type(value).__name__}, expected a float")
        if not math.isfinite(float(value)):
            raise ValueError(f"returned {value}")
        return float(value)

    def score(self, responses: Sequence[str], examples: Sequence[Example]) -> RewardBatch:
        pool = self._executor()
        futures = [pool.submit(partial(self._call, r, e)) for r, e in zip(responses, examples, strict=True)]
        # one deadline for the batch: timeout_s per call, the calls spread over the workers
        deadline = time.monotonic() + self.timeout_s * max(1, math.ceil(len(futures) / self.workers))
        batch = RewardBatch([])
        for fut in futures:
            try:
                batch.rewards.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                batch.rewards.append(0.0)
                batch.timeouts += 1
                batch.first_error = batch.first_error or f"{self.name}: timed out after {self.timeout_s}s"
            except Exception as e:  # a failing user reward scores 0, is counted and logged, and the step goes on
                batch.rewards.append(0.0)
                batch.errors += 1
                batch.first_error = batch.first_error or f"{self.name}: {type(e).__name__}: {e}"
        if batch.timeouts:  # calls still running hold their threads: the next batch gets a fresh pool
            with self._lock:
                pool.shutdown()
                self._pool = None
        return batch


Reward = ExactMatch | PythonReward
