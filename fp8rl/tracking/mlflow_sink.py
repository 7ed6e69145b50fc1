"""MLflow as a ``MetricsSink``: one MLflow run per recipe run, child runs under a comparison run.

Layout. Without ``MLFLOW_TRACKING_URI`` everything lives in the work directory:
``<work_dir>/mlflow.db`` (SQLite tracking store) and ``<work_dir>/mlruns-artifacts/``
(artifact root of experiments created here). With ``MLFLOW_TRACKING_URI`` set (a tracking
server in the cluster) the server decides where artifacts go.

Every call goes through an ``MlflowClient`` with an explicit run id, never through
MLflow's global active-run stack, so several sinks (a comparison run and its recipe
runs, or runs in threads) can be open in one process.

Non-finite metrics are logged as they are: a NaN loss or an infinite scale is what an
FP8 overflow looks like, and dropping it would hide exactly the event the comparison
is about. MLflow stores NaN as NaN; its SQL store clamps +-inf to +-1.797e308.

Telemetry. MLflow >= 3.2 sends usage data unless ``MLFLOW_DISABLE_TELEMETRY`` (or
``DO_NOT_TRACK``) is true (``mlflow/telemetry/utils.py: is_telemetry_disabled``); its
client is created when ``mlflow`` is first imported (``mlflow/__init__.py``). Hence mlflow
is imported inside functions here: ``configure_mlflow`` sets the variable before the first
import and drops a client that an earlier import already made.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8rl.errors import UserError
from fp8rl.tracking.sink import ClosesOnExit, RunStatus, flatten_params

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from fp8rl.tracking.datasets import DatasetRecord

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
TELEMETRY_ENV = "MLFLOW_DISABLE_TELEMETRY"
DB_NAME = "mlflow.db"
ARTIFACTS_DIR = "mlruns-artifacts"
RECIPE_KEY = "recipe"
PARENT_RUN_TAG = "mlflow.parentRunId"


def default_tracking_uri(work_dir: str | os.PathLike[str]) -> str:
    """``$MLFLOW_TRACKING_URI`` if the user set it, else ``sqlite:///<abs work_dir>/mlflow.db``."""
    if uri := os.environ.get(TRACKING_URI_ENV):
        return uri
    return f"sqlite:///{Path(work_dir).resolve() / DB_NAME}"


def default_artifact_location(work_dir: str | os.PathLike[str], tracking_uri: str) -> str | None:
    """Artifact root for new experiments: under the work directory for a local SQLite store.

    ``None`` (the store decides) for anything else; a tracking server knows its own
    artifact store, and MLflow's fallback for SQLite would be ``./mlruns`` of the current
    directory.
    """
    if not tracking_uri.startswith("sqlite:"):
        return None
    return (Path(work_dir).resolve() / ARTIFACTS_DIR).as_uri()


def configure_mlflow(work_dir: str | os.PathLike[str]) -> str:
    """Turn MLflow telemetry off, point MLflow at the tracking store, and return its URI."""
    os.environ[TELEMETRY_ENV] = "true"
    uri = default_tracking_uri(work_dir)
    if uri.startswith("sqlite:"):
        Path(work_dir).mkdir(parents=True, exist_ok=True)  # SQLite creates the file, not its directory

    import mlflow
    from mlflow.telemetry import set_telemetry_client

    set_telemetry_client()  # re-reads the variable: drops a client made by an earlier import
    users = os.environ.get(TRACKING_URI_ENV)
    mlflow.set_tracking_uri(uri)
    # mlflow.set_tracking_uri also exports $MLFLOW_TRACKING_URI; put back the user's value (or
    # none), so the variable keeps meaning "the user chose a store" and a later call for another
    # work dir is not pinned to this one.
    if users is None:
        os.environ.pop(TRACKING_URI_ENV, None)
    else:
        os.environ[TRACKING_URI_ENV] = users
    return uri


def recipe_tags(name: str) -> dict[str, str]:
    """``{"recipe": name}``: pass it both as ``tags=`` and to ``log_params`` of a recipe run."""
    if not name:
        raise UserError("recipe name must not be empty")
    return {RECIPE_KEY: name}


def start_parent_run(
    experiment: str, run_name: str, work_dir: str | os.PathLike[str], tags: Mapping[str, Any] | None = None
) -> str:
    """Start the comparison run that owns one child run per recipe and return its id.

    The run stays RUNNING, because the recipe runs may be other processes (pipeline
    steps); whoever compares them ends it with ``MlflowSink.attach(run_id, work_dir).close()``.
    """
    return MlflowSink(experiment, run_name, work_dir, tags=tags).run_id


class MlflowSink(ClosesOnExit):
    """One MLflow run; a child of ``parent_run_id`` when given.

    ``with MlflowSink(...) as sink:`` ends the run FINISHED, or FAILED when the body
    raises (KILLED on ``KeyboardInterrupt``), and re-raises.
    """

    def __init__(
        self,
        experiment: str,
        run_name: str,
        work_dir: str | os.PathLike[str],
        parent_run_id: str | None = None,
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        self.tracking_uri = configure_mlflow(work_dir)
        from mlflow import MlflowClient

        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment_id = _experiment_id(self._client, experiment, default_artifact_location(work_dir, self.tracking_uri))
        run_tags = {k: str(v) for k, v in (tags or {}).items()}
        if parent_run_id is not None:
            run_tags[PARENT_RUN_TAG] = parent_run_id
        run = self._client.create_run(experiment_id, tags=run_tags, run_name=run_name)
        self.run_id: str = run.info.run_id
        self.experiment_id = experiment_id
        self._closed = False
        self._keep_ended = False
        self._system_metrics: Any = None

    @classmethod
    def attach(cls, run_id: str, work_dir: str | os.PathLike[str], keep_ended: bool = False) -> MlflowSink:
        """A sink for an existing run (e.g. a parent run started by another process).

        ``keep_ended``: closing leaves a run that another process already ended (FAILED by a failed step) as it
        is, instead of overwriting its status: a run's end state is final.
        """
        from mlflow import MlflowClient

        self = cls.__new__(cls)
        self.tracking_uri = configure_mlflow(work_dir)
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self.experiment_id = self._client.get_run(run_id).info.experiment_id
        self.run_id = run_id
        self._closed = False
        self._keep_ended = keep_ended
        self._system_metrics = None
        return self

    def reopen(self) -> None:
        """Mark a FINISHED run RUNNING again while a later step works on it (a pipeline's evaluation of the RL
        run's checkpoint): MLflow's system-metrics sampler logs only into a RUNNING run, and a failure of that step
        then ends the run FAILED.  A FAILED or KILLED run stays as it is."""
        if self._client.get_run(self.run_id).info.status == "FINISHED":
            self._client.update_run(self.run_id, status="RUNNING")

    def start_system_metrics(self, interval_s: float) -> None:
        """MLflow's system metrics (``system/*``) every ``interval_s`` until the run is closed
        (``fp8rl.tracking.system_metrics``)."""
        from fp8rl.tracking.system_metrics import start_system_metrics

        if self._system_metrics is None:
            self._system_metrics = start_system_metrics(self.run_id, self.tracking_uri, interval_s)

    @property
    def artifact_uri(self) -> str:
        return str(self._client.get_run(self.run_id).info.artifact_uri)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        # log_batch splits into MLflow's per-request limits itself (100 params or tags, 1,000 metrics)
        entries = [Param(k, v) for k, v in flatten_params(params).items()]
        self._client.log_batch(self.run_id, params=entries, synchronous=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        entries = [Metric(k, float(v), now_ms, step) for k, v in metrics.items()]
        self._client.log_batch(self.run_id, metrics=entries, synchronous=True)

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self._client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self._client.log_artifact(self.run_id, str(path), artifact_path)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        entries = [RunTag(k, str(v)) for k, v in tags.items()]
        self._client.log_batch(self.run_id, tags=entries, synchronous=True)

    def log_datasets(self, datasets: Sequence[DatasetRecord]) -> None:
        """The run's dataset inputs (``fp8rl.tracking.datasets``), each tagged with its context (training or
        evaluation), as MLflow's UI shows them under "Datasets used"."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = [
            DatasetInput(
                Dataset(d.name, d.digest, d.source_type, json.dumps(d.source), profile=d.profile()),
                tags=[InputTag("mlflow.data.context", d.context)],
            )
            for d in datasets
        ]
        if inputs:
            self._client.log_inputs(self.run_id, datasets=inputs)

    def history(self, metric: str) -> list[tuple[int, float]]:
        """``[(step, value), ...]`` of ``metric`` as the tracking store holds it (a resumed run reads it)."""
        return [(m.step, m.value) for m in self._client.get_metric_history(self.run_id, metric)]

    def close(self, status: RunStatus = "FINISHED") -> None:
        if self._closed:
            return
        if self._system_metrics is not None:
            from fp8rl.tracking.system_metrics import stop_system_metrics

            stop_system_metrics(self._system_metrics)  # its last samples go before the run ends
            self._system_metrics = None
        if not (self._keep_ended and self._client.get_run(self.run_id).info.status != "RUNNING"):
            self._client.set_terminated(self.run_id, status)
        self._closed = True


def _experiment_id(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    """Id of experiment ``name``, created if missing (tolerating a concurrent creator)."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException:
            experiment = client.get_experiment_by_name(name)  # another process created it first
            if experiment is None:
                raise
    if experiment.lifecycle_stage != "active":
        raise UserError(f"MLflow experiment {name!r} is deleted; restore it or choose another experiment name")
    return str(experiment.experiment_id)
