"""Run a pipeline on this machine: ``kfp.local`` (SubprocessRunner, this environment) + in-process RL + MLflow.

The embedded default: every step is the same lightweight component as on Kubeflow Pipelines,
run as a subprocess of this Python (``use_venv=False``: no per-step pip installs); kfp.local
ignores the Kubernetes settings. The RL step runs on a local Ray it starts (``backend=local``),
MLflow is ``$MLFLOW_TRACKING_URI`` or ``<work_dir>/mlflow.db``, and step outputs go under
``<work_dir>/kfp-local/``. Recipes run one after the other (``LOCAL_PARALLELISM``).

kfp.local prints every step's full executor input; the console gets the step and status lines
and the steps' own output, and the whole log goes to ``<work_dir>/kfp-local/<pipeline>-<time>.log``.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

LOCAL_ROOT = "kfp-local"
COMPARE_STEP = "compare-recipes"  # the task whose report every pipeline ends with
# One recipe at a time: on a few cores, parallel steps would only slow each other and skew the benchmark.
LOCAL_PARALLELISM = 1
# No retries: a step's error shows at once (kfp.local honours a step's retry policy, with its backoff).
LOCAL_RETRIES = 0
# Parameters whose cluster defaults (in the IR) do not fit one machine.
LOCAL_DEFAULTS: dict[str, Any] = {"backend": "local"}


@dataclass(frozen=True)
class LocalRun:
    pipeline: str
    report: Path  # the Markdown report the pipeline returns
    table: str
    tracking_uri: str
    log: Path
    seconds: float
    champion: str = ""  # models:/NAME@champion, when the comparison registered one


class _ConsoleFilter(io.TextIOBase):
    """Passes lines to ``console`` except kfp's executor chatter (the executor-input JSON dumps); everything to ``log``."""

    def __init__(self, console: TextIO, log: TextIO, verbose: bool) -> None:
        self.console, self.log, self.verbose = console, log, verbose
        self._buf = ""
        self._dump_end: str | None = None  # the line that closes the executor-input dump being skipped
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        with self._lock:
            self.log.write(s)
            self._buf += s
            *lines, self._buf = self._buf.split("\n")
            for line in lines:
                if self.verbose or self._keep(line):
                    self.console.write(line + "\n")
            self.console.flush()
        return len(s)

    def _keep(self, line: str) -> bool:
        # The dump is json.dumps(..., indent=4) under the executor's log line: it ends with a "}" at that line's indent.
        if self._dump_end is not None:
            if line.rstrip() == self._dump_end:
                self._dump_end = None
            return False
        if "[KFP Executor" in line:
            if "Got executor_input:" in line:
                self._dump_end = line[: len(line) - len(line.lstrip())] + "}"
            return False
        return bool(line.strip())

    def flush(self) -> None:
        with self._lock:
            self.log.flush()
            self.console.flush()


@contextlib.contextmanager
def _filtered_stdout(log_path: Path, verbose: bool) -> Iterator[None]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        original = sys.stdout
        sys.stdout = _ConsoleFilter(original, log, verbose)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stdout = original


def run_locally(
    name: str, pipeline: Any, arguments: Mapping[str, Any], work_dir: Path, verbose: bool = False
) -> LocalRun:
    """Run ``pipeline`` with ``arguments`` (``work_dir`` and the local defaults filled in unless given)."""
    from kfp import local

    from fp8rl.tracking import configure_mlflow

    work_dir = work_dir.resolve()
    inputs = pipeline.component_spec.inputs or {}
    args = {k: v for k, v in LOCAL_DEFAULTS.items() if k in inputs} | {"work_dir": str(work_dir)} | dict(arguments)
    tracking_uri = configure_mlflow(args["work_dir"])
    root = Path(args["work_dir"]) / LOCAL_ROOT
    log_path = root / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    earlier = _run_folders(root, pipeline.name)
    start = time.perf_counter()
    with _filtered_stdout(log_path, verbose), warnings.catch_warnings():
        # our images are not named "python...": kfp.local warns per step, though it never uses them
        warnings.filterwarnings("ignore", message=".*non-Python base image.*", category=RuntimeWarning)
        # display names and Kubernetes settings are for KFP; kfp.local says per step that it ignores them
        warnings.filterwarnings("ignore", message=".*have no effect in the current local runner.*")
        pipeline(**args)
    seconds = time.perf_counter() - start
    report, metadata = _report(_run_folders(root, pipeline.name) - earlier)
    return LocalRun(
        name, report, str(metadata.get("table", "")), tracking_uri, log_path, seconds, str(metadata.get("champion", ""))
    )


def _run_folders(root: Path, pipeline: str) -> set[Path]:
    return {p for p in root.glob(f"{pipeline}-*") if p.is_dir()}


def _report(new_runs: set[Path]) -> tuple[Path, dict[str, Any]]:
    """The compare step's Markdown report and its metadata (the table, the champion), from the run's folder
    (``<root>/<pipeline>-<time>``, one per kfp.local run).  The pipelines return nothing: KFP takes no pipeline output from inside an exit handler."""
    if len(new_runs) != 1:
        raise RuntimeError(f"expected the folder of one kfp.local run, found {sorted(map(str, new_runs))}")
    step = new_runs.pop() / COMPARE_STEP
    try:
        outputs = json.loads((step / "executor_output.json").read_text())
        (artifact,) = outputs["artifacts"]["report"]["artifacts"]
    except (OSError, ValueError, KeyError) as e:
        raise RuntimeError(f"{step}: no report from the {COMPARE_STEP} step ({e!r})") from e
    return step / "report", dict(artifact.get("metadata", {}))
