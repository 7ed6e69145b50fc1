"""Experiment tracking: the ``MetricsSink`` boundary, MLflow behind it, plots and the recipe comparison.

Importing this package does not import mlflow or matplotlib; they load on first use.
"""

from fp8rl.tracking.compare import TOKEN_MULT_PROB_ERROR, RunSummary, comparison_table, fetch_recipe_runs
from fp8rl.tracking.mlflow_sink import (
    MlflowSink,
    configure_mlflow,
    default_artifact_location,
    default_tracking_uri,
    recipe_tags,
    start_parent_run,
)
from fp8rl.tracking.plots import plot_metric_history
from fp8rl.tracking.sink import MAX_PARAM_VALUE_LENGTH, MemorySink, MetricsSink, NullSink, RunStatus, flatten_params

__all__ = [
    "MAX_PARAM_VALUE_LENGTH",
    "TOKEN_MULT_PROB_ERROR",
    "MemorySink",
    "MetricsSink",
    "MlflowSink",
    "NullSink",
    "RunStatus",
    "RunSummary",
    "comparison_table",
    "configure_mlflow",
    "default_artifact_location",
    "default_tracking_uri",
    "fetch_recipe_runs",
    "flatten_params",
    "plot_metric_history",
    "recipe_tags",
    "start_parent_run",
]
