"""The trained checkpoints as MLflow models, and the comparison's winner in the Model Registry.

Each RL run logs its trained checkpoint (the Hugging Face directory the loop saves: config, safetensors, tokenizer)
as an MLflow *logged model* of the run: the directory is copied into the artifact store as the model's artifacts,
tagged with the recipe, the FP8 linear counts and the held-out accuracy. A copy rather than a model version whose
source is the checkpoint's path, because that path is a directory on the pipeline's volume: only pods that mount
the volume can read it, the volume outlives no cleanup, and an MLflow server refuses a local path as a version's
source unless it lies in the run's artifact directory. The copy makes ``models:/NAME@champion`` resolve wherever
the tracking server is reachable (a laptop, a vLLM pod); it costs the checkpoint's bytes in the artifact store once
per run, which ``tracking.log_model: false`` avoids.

The recipe comparison then registers the best recipe's model (``register_champion``): a version of the registered
model named for the run's task (``fp8rl-arithmetic``), alias ``champion``, whose source run is the recipe's run and
which names the comparison run (tag ``fp8rl.comparison_run_id``; the comparison run carries ``fp8rl.champion``).
"""

from __future__ import annotations

import math
import os
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fp8rl.errors import UserError
from fp8rl.tracking.mlflow_sink import PARENT_RUN_TAG, RECIPE_KEY

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

MODEL_ID_TAG = "fp8rl.model_id"  # on a recipe run: its logged model
CHAMPION_TAG = "fp8rl.champion"  # on the comparison run: models:/NAME@champion
COMPARISON_RUN_TAG = "fp8rl.comparison_run_id"  # on the registered version
CHAMPION_ALIAS = "champion"
HELDOUT_ACCURACY_TAG = "heldout_accuracy"
FP8_LINEAR_PARAMS = ("fp8_linears_engine", "fp8_linears_trainer")
# how the champion is chosen: the first of these a run has (the evaluation step's accuracy of the trained
# checkpoint, else the RL run's last held-out accuracy), higher is better; ties go to the lower mismatch
RANKING_METRICS = ("evaluate/accuracy", "summary/final_accuracy")
TIE_BREAK_METRIC = "summary/mean_token_mult_prob_error"


def log_checkpoint_model(
    tracking_uri: str, run_id: str, checkpoint_dir: str | os.PathLike[str], heldout_accuracy: float | None
) -> str:
    """Copy ``checkpoint_dir`` into the artifact store as a logged model of ``run_id``; returns the model's id
    (``models:/<id>``), also set as the run's tag ``fp8rl.model_id``.

    The model is named and tagged after the run: ``recipe``, ``fp8_linears_engine``/``_trainer`` (the run's params,
    when it logged them), ``heldout_accuracy`` and ``fp8rl.checkpoint_uri`` (where the checkpoint was written)."""
    from mlflow import MlflowClient
    from mlflow.entities import LoggedModelOutput

    path = Path(checkpoint_dir)
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: not a trained checkpoint (no config.json); nothing to log as a model")
    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    tags = {RECIPE_KEY: run.data.tags.get(RECIPE_KEY, ""), "fp8rl.checkpoint_uri": str(path.resolve())}
    tags |= {k: run.data.params[k] for k in FP8_LINEAR_PARAMS if k in run.data.params}
    if heldout_accuracy is not None:
        tags[HELDOUT_ACCURACY_TAG] = f"{heldout_accuracy:.6g}"
    model = client.create_logged_model(
        run.info.experiment_id, name=_model_name(run.info.run_name or "checkpoint"), source_run_id=run_id, tags=tags,
        model_type="fp8rl-checkpoint",
    )  # fmt: skip
    try:
        client.log_model_artifacts(model.model_id, str(path))
    except BaseException:
        client.finalize_logged_model(model.model_id, "FAILED")
        raise
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
    client.set_tag(run_id, MODEL_ID_TAG, model.model_id)
    return str(model.model_id)


@dataclass(frozen=True)
class Champion:
    """The registered winner: ``uri`` (``models:/NAME@champion``) loads it."""

    name: str
    version: str
    recipe: str
    run_id: str
    model_id: str
    accuracy: float

    @property
    def uri(self) -> str:
        return f"models:/{self.name}@{CHAMPION_ALIAS}"

    def how_to_load(self, tracking_uri: str) -> str:
        """What it is, and the lines a user runs to fetch and serve it."""
        return (
            f"champion: {self.recipe} (accuracy {self.accuracy:.3f}), registered model {self.name} version "
            f"{self.version}, alias {CHAMPION_ALIAS}\n{load_instructions(self.uri, tracking_uri)}"
        )


def load_instructions(uri: str, tracking_uri: str) -> str:
    """How to fetch the model ``uri`` (``models:/NAME@champion``) from ``tracking_uri`` and serve it with vLLM."""
    name = uri.removeprefix("models:/")
    env, work = f"MLFLOW_TRACKING_URI={tracking_uri} ", ""
    if tracking_uri.startswith("sqlite:///") and tracking_uri.endswith("/mlflow.db"):  # a work dir's own store
        env, work = "", f" --work-dir {tracking_uri.removeprefix('sqlite:///').removesuffix('/mlflow.db')}"
    return (
        f"  fp8rl:    {env}fp8rl models download {name} champion-model{work}\n"
        f"  download: MLFLOW_TRACKING_URI={tracking_uri} mlflow artifacts download -u {uri} -d champion-model\n"
        f"  python:   mlflow.artifacts.download_artifacts('{uri}', dst_path='champion-model')\n"
        f"  serve:    vllm serve champion-model   (a Hugging Face checkpoint directory)"
    )


def register_champion(
    tracking_uri: str, parent_run_id: str, run_ids: Sequence[str] | None = None, name: str = ""
) -> Champion | None:
    """Register the best recipe's model of the comparison ``parent_run_id`` (its recipe runs, or ``run_ids``) as a
    new version of ``name`` (default: ``fp8rl-<task>``), alias ``champion``; None when no run logged a model.

    The best recipe has the highest mean accuracy over its runs (``RANKING_METRICS``); its best run's model wins."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    parent = client.get_run(parent_run_id)
    if run_ids:
        runs = [client.get_run(r) for r in run_ids]
    else:
        query = f"tags.`{PARENT_RUN_TAG}` = '{parent_run_id}'"
        runs = list(client.search_runs([parent.info.experiment_id], query, max_results=10_000))
    scored = [(r, acc) for r in runs if MODEL_ID_TAG in r.data.tags and (acc := _accuracy(r.data.metrics)) is not None]
    if not scored:
        return None
    run, accuracy = _best(scored)
    name = name or registered_model_name(run.data.params)
    model_id = run.data.tags[MODEL_ID_TAG]
    recipe = run.data.tags.get(RECIPE_KEY, "")
    _ensure_registered_model(client, name)
    version = client.create_model_version(
        name, f"models:/{model_id}", run_id=run.info.run_id, model_id=model_id,
        tags={RECIPE_KEY: recipe, COMPARISON_RUN_TAG: parent_run_id, HELDOUT_ACCURACY_TAG: f"{accuracy:.6g}"},
        description=f"{recipe}: the best recipe of comparison run {parent_run_id}",
    )  # fmt: skip
    client.set_registered_model_alias(name, CHAMPION_ALIAS, version.version)
    champion = Champion(name, str(version.version), recipe, run.info.run_id, model_id, accuracy)
    links = {CHAMPION_TAG: champion.uri, f"{CHAMPION_TAG}_version": champion.version}
    links |= {f"{CHAMPION_TAG}_recipe": recipe, f"{CHAMPION_TAG}_run_id": run.info.run_id}
    for key, value in links.items():
        client.set_tag(parent_run_id, key, value)
    return champion


@dataclass(frozen=True)
class ModelVersion:
    """One version of a registered fp8rl model, as ``fp8rl models`` lists it."""

    name: str
    version: str
    aliases: tuple[str, ...]
    recipe: str
    accuracy: str
    run_id: str
    comparison_run_id: str

    @property
    def uri(self) -> str:
        alias = self.aliases[0] if self.aliases else None
        return f"models:/{self.name}@{alias}" if alias else f"models:/{self.name}/{self.version}"


def registered_versions(tracking_uri: str, prefix: str = "fp8rl-") -> list[ModelVersion]:
    """Every version of the registered models named ``prefix...`` in ``tracking_uri``'s registry, newest first
    within a model."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    out = []
    for model in client.search_registered_models(f"name LIKE '{prefix}%'", max_results=1000):
        aliases: dict[str, list[str]] = {}
        for alias, version in (model.aliases or {}).items():
            aliases.setdefault(str(version), []).append(alias)
        versions = client.search_model_versions(f"name = '{model.name}'", max_results=1000)
        for v in sorted(versions, key=lambda v: -int(v.version)):
            tags = v.tags or {}
            out.append(ModelVersion(
                model.name, str(v.version), tuple(sorted(aliases.get(str(v.version), []))),
                tags.get(RECIPE_KEY, ""), tags.get(HELDOUT_ACCURACY_TAG, ""), v.run_id or "",
                tags.get(COMPARISON_RUN_TAG, ""),
            ))  # fmt: skip
    return out


def model_uri(spec: str) -> str:
    """``NAME`` -> ``models:/NAME@champion``; ``NAME@ALIAS``, ``NAME/VERSION`` and ``models:/...`` as given."""
    if spec.startswith("models:/"):
        return spec
    if not re.fullmatch(r"[A-Za-z0-9._-]+(@[A-Za-z0-9_-]+|/\d+)?", spec):
        raise UserError(f"{spec!r}: expected NAME, NAME@ALIAS, NAME/VERSION or models:/...")
    return f"models:/{spec}" if ("@" in spec or "/" in spec) else f"models:/{spec}@{CHAMPION_ALIAS}"


def _artifact_location(client: MlflowClient, uri: str) -> str:
    """Where the files of model ``uri`` (``models:/NAME@ALIAS``, ``models:/NAME/VERSION`` or ``models:/<model id>``)
    lie, read from ``client``'s own store and registry (``download_artifacts`` would resolve a ``models:/`` URI
    through MLflow's global registry, whatever store it is given)."""
    spec = uri.removeprefix("models:/")
    if "@" in spec or "/" in spec:
        name, sep, ref = spec.partition("@") if "@" in spec else spec.rpartition("/")
        version = client.get_model_version_by_alias(name, ref) if sep == "@" else client.get_model_version(name, ref)
        source = version.source or ""
        model_id = version.model_id or (source.removeprefix("models:/") if source.startswith("models:/") else "")
        if not model_id:
            return source  # a version registered from a path: its files are there
    else:
        model_id = spec
    return str(client.get_logged_model(model_id).artifact_location)


def download_model(tracking_uri: str, uri: str, dest: str | os.PathLike[str]) -> Path:
    """The checkpoint of model ``uri`` into ``dest`` (a new directory: written beside it, then renamed, so an
    interrupted download leaves no half checkpoint under that name)."""
    import shutil
    import tempfile

    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    dest = Path(dest)
    if dest.exists():
        raise UserError(f"{dest}: already exists; give a new directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        try:
            client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
            location = _artifact_location(client, uri)
            got = Path(mlflow.artifacts.download_artifacts(location, dst_path=str(tmp), tracking_uri=tracking_uri))
        except MlflowException as e:
            raise UserError(f"{uri}: {e.message}") from None
        if not (got / "config.json").is_file():
            raise UserError(f"{uri}: not an fp8rl checkpoint (no config.json among its files)")
        got.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _ensure_registered_model(client: MlflowClient, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description="The best FP8 recipe's trained checkpoint of each comparison.")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


def registered_model_name(params: Mapping[str, str]) -> str:
    """``fp8rl-<task>``: the task type of a run's params (``task.type``), a file task by its training file's stem
    (``fp8rl-jsonl-mydata``)."""
    task = params.get("task.type", "task")
    if task in ("jsonl", "parquet") and params.get("task.train"):
        task = f"{task}-{Path(params['task.train']).stem}"
    return _model_name(f"fp8rl-{task}")


def _accuracy(metrics: Mapping[str, float]) -> float | None:
    for key in RANKING_METRICS:
        if key in metrics and math.isfinite(metrics[key]):
            return float(metrics[key])
    return None


def _best(scored: Sequence[tuple[Run, float]]) -> tuple[Run, float]:
    by_recipe: dict[str, list[tuple[Run, float]]] = {}
    for run, acc in scored:
        by_recipe.setdefault(run.data.tags.get(RECIPE_KEY, ""), []).append((run, acc))
    recipe = max(sorted(by_recipe), key=lambda r: statistics.fmean(a for _, a in by_recipe[r]))

    def key(item: tuple[Run, float]) -> tuple[float, float]:
        mismatch = item[0].data.metrics.get(TIE_BREAK_METRIC, math.inf)
        return (item[1], -mismatch if math.isfinite(mismatch) else -math.inf)

    return max(by_recipe[recipe], key=key)


def _model_name(text: str) -> str:
    """A name MLflow takes for a logged or registered model (letters, digits, ``-_.``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "model"
