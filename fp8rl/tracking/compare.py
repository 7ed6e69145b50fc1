"""Read recipe runs back from MLflow and tabulate them (bf16 vs fp8-rollout vs fp8-e2e)."""

from __future__ import annotations

import functools
import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fp8rl.errors import UserError
from fp8rl.tracking.mlflow_sink import PARENT_RUN_TAG, RECIPE_KEY

# the key fp8rl.loop logs it under
TOKEN_MULT_PROB_ERROR = "mismatch/token_mult_prob_error"


@dataclass(frozen=True)
class RunSummary:
    """One recipe run: its identity and the full history of each metric, sorted by step."""

    run_id: str
    run_name: str
    recipe: str
    status: str
    start_time_ms: int
    histories: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def final(self, metric: str) -> float | None:
        """Value at the last logged step, or None if the metric was never logged."""
        points = self.histories.get(metric)
        return points[-1][1] if points else None

    def mean(self, metric: str) -> float | None:
        """Mean over all logged steps (NaN if any step was NaN), or None if never logged."""
        points = self.histories.get(metric)
        return math.fsum(v for _, v in points) / len(points) if points else None


def fetch_recipe_runs(
    experiment: str, parent_run_id: str | None, tracking_uri: str, metrics: Sequence[str] | None = None
) -> list[RunSummary]:
    """Runs tagged ``recipe`` in ``experiment`` (children of ``parent_run_id`` when given).

    Fetches the history of ``metrics`` (default: every metric the run logged), sorted
    by recipe and then start time. Deleted runs are left out.
    """
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise UserError(f"MLflow experiment {experiment!r} not found at {tracking_uri}")
    query = f"tags.`{PARENT_RUN_TAG}` = '{parent_run_id}'" if parent_run_id else ""
    summaries: list[RunSummary] = []
    page_token: str | None = None
    while True:
        page = client.search_runs([exp.experiment_id], query, page_token=page_token)
        for run in page:
            recipe = run.data.tags.get(RECIPE_KEY)
            if recipe is None:
                continue
            keys = run.data.metrics.keys() if metrics is None else metrics
            histories = {
                key: [(m.step, m.value) for m in sorted(history, key=lambda m: (m.step, m.timestamp))]
                for key in keys
                if (history := client.get_metric_history(run.info.run_id, key))
            }
            summaries.append(
                RunSummary(
                    run_id=run.info.run_id,
                    run_name=run.info.run_name or "",
                    recipe=recipe,
                    status=run.info.status,
                    start_time_ms=run.info.start_time or 0,
                    histories=histories,
                )
            )
        page_token = page.token
        if not page_token:
            break
    return sorted(summaries, key=lambda s: (s.recipe, s.start_time_ms))


@dataclass(frozen=True)
class Column:
    """One column of a runs table: its header and how a run's cell is written."""

    header: str
    cell: Callable[[RunSummary], str]


def runs_table(runs: Sequence[RunSummary], columns: Sequence[Column]) -> str:
    """The one Markdown table writer of run comparisons: a row per run, ``|`` in a cell escaped."""
    lines = ["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_escape(c.cell(run)) for c in columns) + " |" for run in runs]
    return "\n".join(lines) + "\n"


def runs_html_table(runs: Sequence[RunSummary], columns: Sequence[Column]) -> str:
    """The same table as HTML, every value escaped."""
    head = "".join(f"<th>{html.escape(c.header)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c.cell(run))}</td>" for c in columns) + "</tr>" for run in runs)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def comparison_table(runs: Sequence[RunSummary], metrics: Sequence[str]) -> str:
    """A Markdown table, one row per run: the final value of each metric, and the run-mean
    of ``token_mult_prob_error`` (mean over steps of the per-step value) when any run has it.
    """
    columns = [
        Column("recipe", lambda r: r.recipe),
        Column("run", lambda r: r.run_name),
        Column("status", lambda r: r.status),
        *(Column(f"{m} (final)", functools.partial(_final, metric=m)) for m in metrics),
    ]
    if any(TOKEN_MULT_PROB_ERROR in r.histories for r in runs):
        columns.append(Column("token_mult_prob_error (mean)", lambda r: _number(r.mean(TOKEN_MULT_PROB_ERROR))))
    return runs_table(runs, columns)


def _final(run: RunSummary, metric: str) -> str:
    return _number(run.final(metric))


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.6g}"


def _escape(text: str) -> str:
    return text.replace("|", r"\|")
