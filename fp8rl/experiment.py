"""Tracked RL runs: one MLflow run per recipe and seed, children of one comparison run.

A run logs the full resolved config as params (flattened) and as ``config/resolved.yaml``,
every step's metrics (``fp8rl.loop``), and, at the end, plots of reward, held-out accuracy
and ``token_mult_prob_error`` over steps under ``plots/``.  ``compare_recipes`` runs
several configs under one parent run and gives the parent the same plots with one line
per child, plus ``comparison.md`` (the table of ``fp8rl.tracking.comparison_table``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fp8rl.atomic import atomic_write_text
from fp8rl.build import task_examples
from fp8rl.config import JsonlTaskConfig, RunConfig
from fp8rl.devices import describe_device, resolve_device
from fp8rl.loop import RLResult, run_rl
from fp8rl.provenance import provenance_tags
from fp8rl.tracking import (
    MetricsSink,
    MlflowSink,
    comparison_table,
    fetch_recipe_runs,
    plot_metric_history,
    recipe_tags,
    start_parent_run,
)
from fp8rl.tracking.datasets import DatasetRecord, builtin_dataset, file_dataset
from fp8rl.tracking.models import log_checkpoint_model
from fp8rl.tracking.vocabulary import MEAN_TOKEN_MULT_PROB_ERROR, step_throughput

# metric key in the step history -> file name of its plot
PLOTTED_METRICS: dict[str, str] = {
    "reward": "reward",
    "eval/accuracy": "heldout_accuracy",
    "eval/sampled_accuracy": "heldout_sampled_accuracy",
    "mismatch/token_mult_prob_error": "token_mult_prob_error",
}
MLFLOW_RUN_ID_FILE = "mlflow_run_id"
COMPARED_METRICS = ["eval/accuracy", "eval/sampled_accuracy", "reward", "mismatch/token_mult_prob_error", "time/step_s"]


@dataclass(frozen=True)
class TrackedRun:
    run_id: str
    result: RLResult


@dataclass(frozen=True)
class Comparison:
    parent_run_id: str
    runs: list[TrackedRun]
    table: str


def resolved_config(cfg: RunConfig) -> dict[str, Any]:
    """The run's config with every default filled in, as plain data (what is logged and written)."""
    return cfg.model_dump(mode="json")


def run_name(cfg: RunConfig) -> str:
    return f"{cfg.recipe.name}-seed{cfg.seed}"


def histories(result: RLResult) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(step, value), ...]}`` for the plotted metrics; held-out accuracy includes step 0."""
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in PLOTTED_METRICS}
    for key, value in result.initial.items():
        if key in out:
            out[key].append((0, value))
    for step, metrics in enumerate(result.history, start=1):
        for key in PLOTTED_METRICS:
            if key in metrics:
                out[key].append((step, metrics[key]))
    return out


def log_plots(sink: MetricsSink, per_run: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]]) -> None:
    """One PNG per plotted metric, one line per entry of ``per_run`` (label -> histories), under ``plots/``."""
    with tempfile.TemporaryDirectory(prefix="fp8rl-plots-") as tmp:
        for key, stem in PLOTTED_METRICS.items():
            lines = {label: h[key] for label, h in per_run.items() if h.get(key)}
            if lines:
                plot_metric_history(lines, key, Path(tmp) / f"{stem}.png")
        sink.log_artifact(tmp, "plots")


def log_resolved_config(sink: MetricsSink, cfg: RunConfig) -> None:
    with tempfile.TemporaryDirectory(prefix="fp8rl-config-") as tmp:
        path = Path(tmp) / "resolved.yaml"
        path.write_text(yaml.safe_dump(resolved_config(cfg), sort_keys=False))
        sink.log_artifact(path, "config")


def tracked_run(
    cfg: RunConfig,
    model_dir: str | Path,
    parent_run_id: str | None = None,
    log: Callable[[str], None] = print,
    device: str | None = None,
    output_dir: str | Path | None = None,
    tags: Mapping[str, str] | None = None,
    checkpoint_dir: str | Path | None = None,
) -> TrackedRun:
    """Run the RL loop for ``cfg`` as one MLflow run (a child of ``parent_run_id`` when given).

    ``tags`` are added to the run's (e.g. the KFP run id and component name of a pipeline step);
    ``output_dir`` receives the trained policy (see ``fp8rl.loop.run_rl``).  The loop runs on
    Ray actors when ``cfg.ray`` is set (``fp8rl.cluster.driver``), else in this process.  With
    ``checkpoint_dir`` (and ``cfg.checkpoint_every``) a rerun after a crash resumes the loop
    from its last checkpoint and logs into the same MLflow run.  ``device`` (default ``cfg.device``: ``auto`` is
    CUDA when present) is printed on the run's first line and tagged ``fp8rl.device``.
    """
    where = "ray" if cfg.ray is not None else resolve_device(device or cfg.device, "device")
    described = "ray actors (ray.*)" if cfg.ray is not None else describe_device(where)
    log(f"[{run_name(cfg)}] device: {described}")
    sink = _open_run(cfg, model_dir, parent_run_id, tags, checkpoint_dir)
    with sink:
        if cfg.tracking.system_metrics:
            sink.start_system_metrics(cfg.tracking.system_metrics_interval_s)
        sink.set_tags({"fp8rl.device": described, **provenance_tags()})
        if output_dir is not None:  # where the trained policy is written (a path on the shared volume, on a cluster)
            sink.set_tags({"fp8rl.checkpoint_uri": str(Path(output_dir).resolve())})
        if cfg.ray is not None:  # it tags the Ray cluster's GPUs once connected
            from fp8rl.cluster.driver import run_rl_on_ray

            result = run_rl_on_ray(cfg, model_dir, sink, log, output_dir, checkpoint_dir)
        else:
            result = run_rl(cfg, model_dir, sink, log, where, output_dir, checkpoint_dir=checkpoint_dir)
        log_plots(sink, {run_name(cfg): histories(result)})
        sink.log_metrics(run_summary(result), step=cfg.steps)
        if output_dir is not None and cfg.tracking.log_model:
            model_id = log_checkpoint_model(
                sink.tracking_uri, sink.run_id, output_dir, result.final.get("eval/accuracy")
            )
            log(f"[{run_name(cfg)}] trained checkpoint logged as MLflow model models:/{model_id}")
        return TrackedRun(sink.run_id, result)


def run_summary(result: RLResult) -> dict[str, float]:
    """The run's ``summary/*`` metrics (``fp8rl.tracking.vocabulary``): held-out accuracy and the other evaluation
    keys before and after, the run mean of token_mult_prob_error, and the median step time and tokens/s."""
    return {
        **{f"summary/initial_{k.split('/')[-1]}": v for k, v in result.initial.items()},
        **{f"summary/final_{k.split('/')[-1]}": v for k, v in result.final.items()},
        MEAN_TOKEN_MULT_PROB_ERROR: result.run_mean("mismatch/token_mult_prob_error"),
        **step_throughput(result.history),
    }


def _open_run(
    cfg: RunConfig,
    model_dir: str | Path,
    parent_run_id: str | None,
    tags: Mapping[str, str] | None,
    checkpoint_dir: str | Path | None,
) -> MlflowSink:
    """A new MLflow run, or the run a checkpointed earlier attempt of this run was logging into."""
    run_id_file = Path(checkpoint_dir) / MLFLOW_RUN_ID_FILE if checkpoint_dir is not None else None
    if run_id_file is not None and run_id_file.is_file():
        return MlflowSink.attach(run_id_file.read_text().strip(), cfg.work_dir)
    all_tags = {**recipe_tags(cfg.recipe.name), "seed": str(cfg.seed), **(tags or {})}
    sink = MlflowSink(cfg.experiment, run_name(cfg), cfg.work_dir, parent_run_id=parent_run_id, tags=all_tags)
    params = resolved_config(cfg)
    # "recipe" is the recipe's name (param and tag alike); its settings go under recipe_config.*
    params["recipe_config"] = params.pop("recipe")
    sink.log_params({**params, "recipe": cfg.recipe.name, "model_dir": str(model_dir)})
    log_resolved_config(sink, cfg)
    sink.log_datasets(run_datasets(cfg))
    if run_id_file is not None:
        run_id_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_id_file, sink.run_id + "\n")
    return sink


def run_datasets(cfg: RunConfig) -> list[DatasetRecord]:
    """The run's training pool and held-out set as MLflow dataset inputs: the task's files, or the built-in task
    and the settings that generate its problems."""
    train, test = task_examples(cfg)
    t = cfg.task
    if isinstance(t, JsonlTaskConfig):
        return [file_dataset(t.train, "training", train), file_dataset(t.test, "evaluation", test)]
    settings = t.model_dump(exclude={"type", "chat_template", "system_prompt"})
    return [
        builtin_dataset(t.type, "train", "training", settings, train),
        builtin_dataset(t.type, "test", "evaluation", {**settings, "eval_examples": cfg.eval_examples}, test),
    ]


def compare_recipes(
    cfgs: Sequence[RunConfig],
    model_dir: str | Path | Mapping[int, str | Path],
    name: str = "recipe-comparison",
    log: Callable[[str], None] = print,
    device: str | None = None,
) -> Comparison:
    """Run every config as a child of one parent run, then log the comparison plots and table on the parent.

    ``model_dir`` is one checkpoint for every run, or one per seed (``{seed: dir}``).
    """
    if not cfgs:
        raise ValueError("compare_recipes needs at least one config")
    first = cfgs[0]
    if any(c.experiment != first.experiment or c.work_dir != first.work_dir for c in cfgs):
        raise ValueError("configs of one comparison must share experiment and work_dir")
    parent_id = start_parent_run(first.experiment, name, first.work_dir, tags={"fp8rl.comparison": "true"})
    with MlflowSink.attach(parent_id, first.work_dir) as parent:
        parent.log_params(
            {"recipes": ",".join(c.recipe.name for c in cfgs), "seeds": ",".join(str(c.seed) for c in cfgs)}
        )
        runs = []
        for i, cfg in enumerate(cfgs, start=1):
            log(f"== run {i}/{len(cfgs)}: {run_name(cfg)} ==")
            model = model_dir[cfg.seed] if isinstance(model_dir, Mapping) else model_dir
            runs.append(tracked_run(cfg, model, parent_run_id=parent_id, log=log, device=device))
        log_plots(parent, {run_name(c): histories(r.result) for c, r in zip(cfgs, runs, strict=True)})
        summaries = fetch_recipe_runs(first.experiment, parent_id, parent.tracking_uri, COMPARED_METRICS)
        table = comparison_table(summaries, COMPARED_METRICS)
        with tempfile.TemporaryDirectory(prefix="fp8rl-compare-") as tmp:
            (Path(tmp) / "comparison.md").write_text(table)
            parent.log_artifact(Path(tmp) / "comparison.md")
    return Comparison(parent_id, runs, table)
