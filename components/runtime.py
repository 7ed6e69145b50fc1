"""What the component bodies share at run time: run configs, the MLflow run reference, tags, KFP metrics.

Imported inside component bodies (``from components.runtime import ...``), so it is plain
Python over ``fp8rl`` and must stay cheap to import (no torch at module level).

The MLflow comparison run travels between steps as a KFP artifact (``mlflow_run``): a small
JSON file ``{"run_id", "experiment", "work_dir", "tracking_uri"}``, repeated in the artifact's
metadata so the KFP UI shows it. An artifact rather than a string parameter because kfp.local
(2.17) replaces every upstream *parameter* that enters a ``dsl.ParallelFor`` with the loop
item; artifacts enter intact, on both runners.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8rl.atomic import atomic_write_text
from fp8rl.errors import UserError

if TYPE_CHECKING:
    from kfp.dsl import Artifact, Metrics

    from fp8rl.config import RunConfig, TrackingConfig
    from fp8rl.tracking import MlflowSink

# MLflow tags linking a run to the KFP run and step that made it (search: tags."kfp.run_id" = '<id>').
TAG_KFP_RUN_ID = "kfp.run_id"
TAG_KFP_RUN_NAME = "kfp.run_name"
TAG_KFP_PIPELINE = "kfp.pipeline"
TAG_KFP_COMPONENT = "kfp.component"
BACKENDS = ("local", "process", "rayjob")  # the RL step: a local Ray, the step's own process, a RayJob


@dataclass(frozen=True)
class MlflowRunRef:
    """Where a pipeline run's MLflow comparison run lives."""

    run_id: str
    experiment: str
    work_dir: str
    tracking_uri: str


def write_run_ref(artifact: Artifact, ref: MlflowRunRef) -> None:
    atomic_write_text(artifact.path, json.dumps(asdict(ref), indent=2) + "\n")
    artifact.metadata.update(asdict(ref))


def read_run_ref(artifact: Artifact) -> MlflowRunRef:
    path = Path(artifact.path)
    try:
        data = json.loads(path.read_text())
        return MlflowRunRef(**{k: str(data[k]) for k in ("run_id", "experiment", "work_dir", "tracking_uri")})
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{path}: not an MLflow run reference written by the start-tracking step ({e})") from None


def kfp_tags(pipeline: str, kfp_run_id: str, component: str, kfp_run_name: str = "") -> dict[str, str]:
    tags = {TAG_KFP_PIPELINE: pipeline, TAG_KFP_RUN_ID: kfp_run_id, TAG_KFP_COMPONENT: component}
    if kfp_run_name:
        tags[TAG_KFP_RUN_NAME] = kfp_run_name
    return tags


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise UserError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")


def run_config(recipe: str, steps: int, seed: int, overrides: Mapping[str, Any], ref: MlflowRunRef) -> RunConfig:
    """The RunConfig of one recipe: ``overrides`` (RunConfig fields, e.g. ``{"grpo": {"group_size": 4}}``),
    then the step's own values, which win. Errors name the field (``fp8rl.config.ConfigError``)."""
    from fp8rl.config import load_recipe, parse_run_config

    fixed = {"recipe": load_recipe(recipe), "steps": steps, "seed": seed}
    fixed |= {"work_dir": ref.work_dir, "experiment": ref.experiment}
    clash = sorted(set(overrides) & {"recipe", "steps", "seed", "work_dir", "experiment", "model"})
    if clash:
        raise UserError(f"run_config: {clash} are pipeline parameters of their own; remove them from run_config")
    # KFP passes JSON numbers as floats (2 -> 2.0); pydantic accepts integral floats for int fields.
    return parse_run_config({**overrides, **fixed}, source="run_config parameter")


def rl_step_config(
    backend: str, recipe: str, steps: int, seed: int, overrides: Mapping[str, Any], ref: MlflowRunRef
) -> RunConfig:
    """``run_config`` for the RL step on ``backend``: ``process`` runs without Ray (``overrides.ray`` refused),
    ``local`` on RayConfig's defaults (one trainer, one rollout worker) unless ``overrides`` has a ``ray``."""
    if backend == "process" and "ray" in overrides:
        raise UserError("run_config.ray: backend 'process' runs without Ray; leave ray out or use backend 'local'")
    if backend == "local" and "ray" not in overrides:
        overrides = {**overrides, "ray": {}}
    return run_config(recipe, steps, seed, overrides, ref)


def log_kfp_metrics(artifact: Metrics, metrics: Mapping[str, float]) -> None:
    """Scalars into a KFP Metrics artifact; non-finite values are left out (the IR's JSON has no NaN)."""
    for key, value in sorted(metrics.items()):
        if math.isfinite(value):
            artifact.log_metric(key, float(value))


def run_metrics(run_id: str, work_dir: str, prefix: str = "") -> dict[str, float]:
    """The latest value of each metric of an MLflow run whose key starts with ``prefix``."""
    from mlflow import MlflowClient

    from fp8rl.tracking import configure_mlflow

    client = MlflowClient(tracking_uri=configure_mlflow(work_dir))
    return {k: v for k, v in client.get_run(run_id).data.metrics.items() if k.startswith(prefix)}


@contextlib.contextmanager
def recipe_run(
    ref: MlflowRunRef, run_id: str, recipe: str, seed: int, tags: Mapping[str, str], tracking: TrackingConfig
) -> Iterator[MlflowSink]:
    """The recipe's MLflow run while a step works on it: the run ``run_id`` (the RL step's, which ended it) RUNNING
    again, or, when ``run_id`` is empty, a new child run of the comparison run (``<recipe>-<component>``, tagged
    ``recipe`` and ``seed``). MLflow's system metrics sample the step's machine meanwhile (``tracking``); the run
    ends FINISHED, or FAILED when the body raises (a run that was FAILED before stays so)."""
    from fp8rl.tracking import MlflowSink, recipe_tags

    recipe = recipe_name(recipe)
    if run_id:
        sink = MlflowSink.attach(run_id, ref.work_dir, keep_ended=True)
        sink.reopen()
    else:
        name = f"{recipe}-{tags.get(TAG_KFP_COMPONENT, 'step')}"
        sink = MlflowSink(ref.experiment, name, ref.work_dir, ref.run_id, {**recipe_tags(recipe), "seed": seed, **tags})
        sink.log_params(recipe_tags(recipe))
    with sink:
        if tracking.system_metrics:
            sink.start_system_metrics(tracking.system_metrics_interval_s)
        yield sink


def recipe_name(recipe: str) -> str:
    """The name a recipe's runs are tagged with: a built-in recipe's own, or the ``name`` inside a recipe file
    (a step is given the file's path); a clear error when it is neither (``fp8rl.config.load_recipe``)."""
    from fp8rl.config import BUILTIN_RECIPES, load_recipe

    return recipe if recipe in BUILTIN_RECIPES else load_recipe(recipe).name


# the MLflow tag on a comparison run that a failed step ended: which step, and its error
TAG_FAILED_STEP = "fp8rl.failed_step"


@contextlib.contextmanager
def runs_fail_with_the_step(
    ref: MlflowRunRef, component: str, recipe: str = "", seed: int | None = None
) -> Iterator[None]:
    """When the step fails (an exception, or SIGTERM from a cancelled run: ``fp8rl.kube.submit.Terminated``), end
    the comparison run and this recipe's runs that are still RUNNING under it as FAILED (KILLED when terminated),
    tagged ``fp8rl.failed_step``, instead of leaving them RUNNING for ever; then re-raise.  Other recipes' runs,
    which may still be training, are left alone.  A failure to reach MLflow here is reported, not raised over the
    step's own error."""
    try:
        yield
    except BaseException as e:
        status = "FAILED" if isinstance(e, Exception) else "KILLED"
        try:
            _end_runs(ref, component, recipe, seed, status, f"{type(e).__name__}: {e}"[:500])
        except Exception as mark_error:  # the step's error is the one to raise; say why the runs stay RUNNING
            print(f"[{component}] could not mark the MLflow runs {status}: {mark_error}", flush=True)
        raise


def _end_runs(ref: MlflowRunRef, component: str, recipe: str, seed: int | None, status: str, error: str) -> None:
    from mlflow import MlflowClient

    from fp8rl.tracking import configure_mlflow

    client = MlflowClient(tracking_uri=configure_mlflow(ref.work_dir))
    parent = client.get_run(ref.run_id)
    query = f"tags.mlflow.parentRunId = '{ref.run_id}' and attributes.status = 'RUNNING'"
    if recipe:
        with contextlib.suppress(UserError):  # an unreadable recipe file: its runs carry no other name to look for
            recipe = recipe_name(recipe)
        query += f" and tags.recipe = '{recipe}'"
    if seed is not None:
        query += f" and tags.seed = '{seed}'"
    mine = client.search_runs([parent.info.experiment_id], query) if recipe else []
    for run in [*mine, parent]:
        if run.info.status == "RUNNING":
            client.set_tag(run.info.run_id, TAG_FAILED_STEP, component)
            client.set_tag(run.info.run_id, "fp8rl.error", error)
            client.set_terminated(run.info.run_id, status)
    print(f"[{component}] ended {len(mine)} recipe run(s) and the comparison run {ref.run_id} as {status}", flush=True)


# KFP's final pipeline states (``dsl.PipelineTaskFinalStatus.state``) as MLflow run statuses
_KFP_TO_MLFLOW_STATUS = {"SUCCEEDED": "FINISHED", "CANCELED": "KILLED", "CANCELLED": "KILLED"}


def end_kfp_run_runs(work_dir: str, experiment: str, kfp_run_id: str, kfp_state: str, error: str = "") -> list[str]:
    """The exit handler's work: every MLflow run of KFP run ``kfp_run_id`` (tag ``kfp.run_id``) in ``experiment``
    that is still RUNNING ends as the pipeline ended (SUCCEEDED -> FINISHED, CANCELLED -> KILLED, else FAILED),
    tagged ``fp8rl.ended_by=exit-handler``; a failed run also gets ``fp8rl.error`` unless a step set it.  Runs a
    step already ended keep their status.  Returns the ids of the runs it ended."""
    from mlflow import MlflowClient

    from fp8rl.tracking import configure_mlflow

    status = _KFP_TO_MLFLOW_STATUS.get(kfp_state.upper(), "FAILED")
    client = MlflowClient(tracking_uri=configure_mlflow(work_dir))
    found = client.get_experiment_by_name(experiment)
    if found is None:  # the start step never ran: nothing to end
        print(f"[finish-tracking] no MLflow experiment {experiment!r}: no run to end", flush=True)
        return []
    query = f"tags.`{TAG_KFP_RUN_ID}` = '{kfp_run_id}' and attributes.status = 'RUNNING'"
    ended = []
    for run in client.search_runs([found.experiment_id], query, max_results=10_000):
        rid = run.info.run_id
        client.set_tag(rid, "fp8rl.ended_by", "exit-handler")
        client.set_tag(rid, "fp8rl.kfp_state", kfp_state)
        if status != "FINISHED" and "fp8rl.error" not in run.data.tags:
            client.set_tag(rid, "fp8rl.error", (error or f"the KFP run ended {kfp_state}")[:500])
        client.set_terminated(rid, status)
        ended.append(rid)
    print(f"[finish-tracking] KFP run {kfp_run_id} {kfp_state}: {len(ended)} MLflow run(s) ended {status}", flush=True)
    return ended
