"""The accuracy study: does an FP8 recipe train a model as well as BF16?  Recipes x seeds, held-out accuracy.

``run_study`` runs every (recipe, seed) of a run config as its own ``fp8rl train`` process, several at once on one
device (a small model leaves a GPU mostly idle), each a child of one MLflow comparison run and each checkpointed,
so that a study stopped at ``deadline_s`` (or killed) resumes where its runs stopped when started again.
``study_report`` then reads the runs back from MLflow and gives, per recipe, held-out accuracy at step 0 and at the
end (mean and sample std over the seeds), the run-mean mismatch metrics and how many linears are FP8; it checks
the published claims (``TARGETS``), logs accuracy and mismatch curves and the table on the parent run, and writes
one JSON record per run.

Files under ``<work_dir>/<study>/``: ``parent_run_id``, ``runs/<recipe>-seed<seed>/`` (the run's config, its loop
checkpoints while it runs, ``train.log`` and ``done`` once it finished).  A loop checkpoint holds the FP32 weights and
AdamW's two moments (12 bytes a parameter: 3.2 GB for a 268M-parameter model), a run keeps ``checkpoint_keep`` of
them and writes the next beside them, so before any run starts the study checks that the disk holds that for the
runs at once, and a finished run's checkpoints are removed (``keep_checkpoints`` keeps them).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from fp8rl.atomic import atomic_write_text
from fp8rl.config import RunConfig
from fp8rl.errors import UserError

# a loop checkpoint's bytes per model parameter: the FP32 master weight and AdamW's two FP32 moments
CHECKPOINT_BYTES_PER_PARAMETER = 12

PARENT_RUN_ID_FILE = "parent_run_id"
DONE_FILE = "done"
ACCURACY = "eval/accuracy"
MISMATCH_METRICS = ("mismatch/token_mult_prob_error", "mismatch/gen_kl", "mismatch/policy_kl")


def run_name(recipe: str, seed: int) -> str:
    return f"{recipe}-seed{seed}"


@dataclass
class StudyRun:
    """One (recipe, seed) of a study: its config, its directory, and its process while it runs."""

    cfg: RunConfig
    directory: Path
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0

    @property
    def name(self) -> str:
        return run_name(self.cfg.recipe.name, self.cfg.seed)

    @property
    def done(self) -> bool:
        return (self.directory / DONE_FILE).is_file()


def study_dir(work_dir: str | Path, study: str) -> Path:
    return Path(work_dir) / study


def parent_run(cfgs: Sequence[RunConfig], study: str) -> str:
    """The study's MLflow parent run: the one recorded under its directory, else a new one (recorded)."""
    from fp8rl.tracking import MlflowSink, start_parent_run

    first = cfgs[0]
    path = study_dir(first.work_dir, study) / PARENT_RUN_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    parent_id = start_parent_run(first.experiment, study, first.work_dir, tags={"fp8rl.comparison": "true"})
    with MlflowSink.attach(parent_id, first.work_dir) as parent:
        parent.log_params(
            {
                "recipes": ",".join(dict.fromkeys(c.recipe.name for c in cfgs)),
                "seeds": ",".join(dict.fromkeys(str(c.seed) for c in cfgs)),
                "steps": first.steps,
                "model_dir": str(first.model),
            }
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, parent_id + "\n")
    return parent_id


def _launch(run: StudyRun, parent_id: str, python: str) -> None:
    run.directory.mkdir(parents=True, exist_ok=True)
    config = run.directory / "config.yaml"
    atomic_write_text(config, yaml.safe_dump(run.cfg.model_dump(mode="json"), sort_keys=False))
    cmd = [python, "-m", "fp8rl", "train", "--config", str(config), "--parent-run-id", parent_id,
           "--checkpoint-dir", str(run.directory / "checkpoints")]  # fmt: skip
    log = (run.directory / "train.log").open("ab")
    # a process group of its own: stopping the run at the deadline stops whatever it started
    run.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    run.started = time.monotonic()


def _stop(run: StudyRun, grace_s: float = 20.0) -> None:
    """Stop a run at the deadline; it resumes from its last checkpoint when the study is started again."""
    if run.proc is None or run.proc.poll() is not None:
        return
    os.killpg(run.proc.pid, signal.SIGTERM)
    try:
        run.proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(run.proc.pid, signal.SIGKILL)
        run.proc.wait()


def run_study(
    cfgs: Sequence[RunConfig],
    study: str = "accuracy",
    parallel: int = 1,
    deadline_s: float | None = None,
    stagger_s: float = 0.0,
    log: Callable[[str], None] = print,
    python: str = sys.executable,
    keep_checkpoints: bool = False,
) -> dict[str, list[str]]:
    """Run every config (one ``fp8rl train`` process each, ``parallel`` at a time) as children of the study's
    parent run, until all are done or ``deadline_s`` seconds have passed (then the running ones are stopped, to
    resume from their checkpoints next time).  Returns ``{"done": [...], "failed": [...], "pending": [...]}``.

    Every config must set ``model`` and ``checkpoint_every`` (a run without checkpoints could not resume), and all
    must share ``work_dir`` and ``experiment``.  Raises ``UserError`` before any run starts when the disk under
    ``work_dir`` cannot hold the runs' loop checkpoints (``disk_needed``).
    """
    _check_study(cfgs)
    root = study_dir(cfgs[0].work_dir, study) / "runs"
    runs = [StudyRun(c, root / run_name(c.recipe.name, c.seed)) for c in cfgs]
    queue = [r for r in runs if not r.done]
    _check_disk(queue, parallel, keep_checkpoints, Path(cfgs[0].work_dir), log)
    parent_id = parent_run(cfgs, study)
    log(f"study {study}: {len(runs) - len(queue)} of {len(runs)} runs done; parent run {parent_id}")
    t0 = time.monotonic()
    active: list[StudyRun] = []
    failed: list[str] = []
    last_launch = -math.inf
    while queue or active:
        if deadline_s is not None and time.monotonic() - t0 > deadline_s:
            log(f"study {study}: deadline of {deadline_s:.0f}s reached; stopping {len(active)} runs (they resume)")
            for r in active:
                _stop(r)
            break
        _reap(active, failed, log, keep_checkpoints)
        if queue and len(active) < parallel and time.monotonic() - last_launch >= stagger_s:
            r = queue.pop(0)
            _launch(r, parent_id, python)
            active.append(r)
            last_launch = time.monotonic()
            log(f"  {r.name}: started ({len(active)} running, {len(queue)} waiting)")
            continue
        time.sleep(0.5)
    return {
        "done": [r.name for r in runs if r.done],
        "failed": failed,
        "pending": [r.name for r in runs if not r.done and r.name not in failed],
    }


def _reap(active: list[StudyRun], failed: list[str], log: Callable[[str], None], keep_checkpoints: bool) -> None:
    """Take the runs that exited out of ``active``: a run that succeeded is marked done (and its loop checkpoints,
    which only a resume reads, are removed unless ``keep_checkpoints``), one that failed is named in ``failed``."""
    for r in list(active):
        rc = r.proc.poll() if r.proc is not None else None
        if rc is None:
            continue
        active.remove(r)
        if rc == 0:
            atomic_write_text(r.directory / DONE_FILE, f"{time.time():.0f}\n")
            if not keep_checkpoints:
                shutil.rmtree(r.directory / "checkpoints", ignore_errors=True)
            log(f"  {r.name}: done in {time.monotonic() - r.started:.0f}s")
        else:
            failed.append(r.name)
            log(f"  {r.name}: failed (exit {rc}); see {r.directory / 'train.log'}")


def _check_study(cfgs: Sequence[RunConfig]) -> None:
    if not cfgs:
        raise UserError("the study has no runs: name at least one recipe and one seed")
    first = cfgs[0]
    for c in cfgs:
        if c.work_dir != first.work_dir or c.experiment != first.experiment:
            raise UserError("work_dir and experiment: every run of a study must share them")
        if not c.model:
            raise UserError("model: the study trains a given checkpoint; set model (or --model)")
        if not c.checkpoint_every:
            raise UserError("checkpoint_every: a study's runs must checkpoint (>= 1) to resume after a stop")
    names = [run_name(c.recipe.name, c.seed) for c in cfgs]
    if len(set(names)) != len(names):
        raise UserError(f"recipes and seeds: a (recipe, seed) pair is given twice in {names}")


def model_parameters(model_dir: str | Path) -> int | None:
    """The parameter count of an HF checkpoint directory, from its safetensors headers (no tensor is read); None
    when it has no safetensors checkpoint."""
    from fp8rl.checkpoint.convert import read_headers
    from fp8rl.checkpoint.shards import INDEX_NAME, SINGLE_NAME, shard_layout

    root = Path(model_dir)
    if not (root / SINGLE_NAME).is_file() and not (root / INDEX_NAME).is_file():
        return None
    return sum(math.prod(shape) for _, shape in read_headers(root, shard_layout(root).files).values())


def disk_needed(parameters: int, runs: int, parallel: int, keep_checkpoints: bool, keep: int) -> int:
    """Bytes of loop checkpoints a study of ``runs`` pending runs holds at its peak, ``parallel`` at once: each
    running run keeps ``keep`` checkpoints (``checkpoint_keep``) and writes one more beside them; a finished run
    keeps ``keep`` when ``keep_checkpoints``, none otherwise."""
    one = parameters * CHECKPOINT_BYTES_PER_PARAMETER
    at_once = min(parallel, runs)
    finished = (runs - at_once) * keep if keep_checkpoints else 0
    return (at_once * (keep + 1) + finished) * one


def _check_disk(
    queue: Sequence[StudyRun], parallel: int, keep_checkpoints: bool, work_dir: Path, log: Callable[[str], None]
) -> None:
    if not queue:
        return
    keep = max(r.cfg.checkpoint_keep for r in queue)
    parameters = model_parameters(queue[0].cfg.model) if queue[0].cfg.model else None
    if parameters is None:
        log(f"study: {queue[0].cfg.model} has no safetensors file: the checkpoints' disk use is not checked")
        return
    need = disk_needed(parameters, len(queue), parallel, keep_checkpoints, keep)
    # what the pending runs' checkpoints already take is part of that need, and not free
    need -= sum(f.stat().st_size for r in queue for f in (r.directory / "checkpoints").rglob("*") if f.is_file())
    probe = work_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    one = parameters * CHECKPOINT_BYTES_PER_PARAMETER / 1e9
    if need > free:
        raise UserError(
            f"--parallel {parallel}: the runs' loop checkpoints need up to {need / 1e9:.1f} GB under {work_dir}, "
            f"{free / 1e9:.1f} GB are free (a checkpoint is {one:.2f} GB: the FP32 weights and AdamW state of "
            f"{parameters / 1e6:.0f}M parameters; each running run keeps {keep} (checkpoint_keep) and writes one more): run "
            "fewer at once (--parallel), keep fewer checkpoints, or free space"
        )
    log(f"study: loop checkpoints of {one:.2f} GB; up to {max(need, 0) / 1e9:.1f} GB of the {free / 1e9:.1f} GB free")
