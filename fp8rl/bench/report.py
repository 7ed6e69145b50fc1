"""The recipe-comparison report: accuracy, mismatch and throughput per recipe, read back from MLflow.

One row per recipe run (the children of one comparison run), with what the pipeline's steps
logged to that run:

| column | MLflow metric (logged by) |
|---|---|
| accuracy start -> end | ``summary/initial_accuracy``, ``summary/final_accuracy`` (the RL run, greedy held-out) |
| evaluated accuracy, sampled | ``evaluate/accuracy``, ``evaluate/sampled_accuracy`` (evaluation of the trained checkpoint) |
| token_mult_prob_error | ``summary/mean_token_mult_prob_error`` (run mean of the per-step value) |
| step, generate, train s; rollout / train tok/s, sync | ``bench/*`` (``fp8rl.bench.throughput``: medians of the timed steps) |
| vs bf16 accuracy | each FP8 recipe's mean ``summary/final_accuracy`` over its runs against the bf16 runs': "at parity" or "N points under BF16 (outside the seeds' spread)" (``fp8rl.accuracy.report.parity_verdict``) |

A missing metric shows as ``n/a`` (e.g. a benchmark-only run has no accuracy). The report is
Markdown (the table) and a self-contained HTML page (the table and the plots of reward,
held-out accuracy and token_mult_prob_error over steps, embedded as PNG data URIs), so that
both the KFP UI and a browser render it without other files.
"""

from __future__ import annotations

import base64
import functools
import html
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fp8rl.atomic import atomic_write_bytes, atomic_write_text
from fp8rl.errors import UserError
from fp8rl.tracking import RunSummary, fetch_recipe_runs, plot_metric_history
from fp8rl.tracking.compare import Column, runs_html_table, runs_table

# (header, metric, format) of each numeric column
COLUMNS: list[tuple[str, str, str]] = [
    ("accuracy start", "summary/initial_accuracy", "{:.3f}"),
    ("accuracy end", "summary/final_accuracy", "{:.3f}"),
    ("evaluated accuracy", "evaluate/accuracy", "{:.3f}"),
    ("evaluated sampled", "evaluate/sampled_accuracy", "{:.3f}"),
    ("token_mult_prob_error", "summary/mean_token_mult_prob_error", "{:.5f}"),
    ("step s", "bench/step_s", "{:.2f}"),
    ("generate s", "bench/generate_s", "{:.2f}"),
    ("train s", "bench/train_s", "{:.2f}"),
    ("rollout tok/s", "bench/rollout_tokens_per_s", "{:.0f}"),
    ("train tok/s", "bench/train_tokens_per_s", "{:.0f}"),
    ("sync s", "bench/sync_s", "{:.4f}"),
    ("sync MiB", "bench/sync_bytes", "MiB"),
]
# metric history -> plot file name
PLOTS: dict[str, str] = {
    "reward": "reward.png",
    "eval/accuracy": "heldout_accuracy.png",
    "mismatch/token_mult_prob_error": "token_mult_prob_error.png",
}
REPORT_MD = "comparison.md"
REPORT_HTML = "comparison.html"


@dataclass(frozen=True)
class ComparisonReport:
    """``table`` is the Markdown table alone (for a terminal); ``markdown`` and ``html`` the full report."""

    table: str
    markdown: str
    html: str
    plots: dict[str, bytes] = field(default_factory=dict)  # file name -> PNG bytes
    runs: list[RunSummary] = field(default_factory=list)

    def write(self, directory: str | Path) -> Path:
        """Write ``comparison.md``, ``comparison.html`` and ``plots/*.png`` into ``directory`` (each atomically)."""
        out = Path(directory)
        atomic_write_text(out / REPORT_MD, self.markdown)
        atomic_write_text(out / REPORT_HTML, self.html)
        for name, png in self.plots.items():
            atomic_write_bytes(out / "plots" / name, png)
        return out


def _cell(run: RunSummary, metric: str, fmt: str) -> str:
    value = run.final(metric)
    if value is None:
        return "n/a"
    if math.isnan(value):
        return "nan"
    if fmt == "MiB":
        return f"{value / 2**20:.2f}"
    return fmt.format(value)


def accuracy_verdicts(runs: Sequence[RunSummary]) -> dict[str, str]:
    """Each non-bf16 recipe's final accuracy (mean over its runs) against the bf16 runs' (``parity_verdict``); no
    verdicts without bf16 runs or final accuracies."""
    from fp8rl.accuracy.report import BF16, parity_verdict

    finals: dict[str, list[float]] = {}
    for r in runs:
        value = r.final("summary/final_accuracy")
        if value is not None and not math.isnan(value):
            finals.setdefault(r.recipe, []).append(value)
    bf16 = finals.get(BF16)
    if not bf16:
        return {}
    return {k: parity_verdict(sum(v) / len(v), bf16) for k, v in finals.items() if k != BF16}


def _columns(runs: Sequence[RunSummary]) -> list[Column]:
    verdicts = accuracy_verdicts(runs)
    return [
        Column("recipe", lambda r: r.recipe),
        *(Column(h, functools.partial(_cell, metric=m, fmt=f)) for h, m, f in COLUMNS),
        Column("vs bf16 accuracy", lambda r: verdicts.get(r.recipe, "-")),
        Column("run", lambda r: r.run_name),  # <recipe>-seed<N>: which seed, when a recipe runs with several
        Column("status", lambda r: r.status),
        Column("MLflow run", lambda r: r.run_id),
    ]


def markdown_table(runs: Sequence[RunSummary]) -> str:
    return runs_table(runs, _columns(runs))


def _html_table(runs: Sequence[RunSummary]) -> str:
    return runs_html_table(runs, _columns(runs))


def _plots(runs: Sequence[RunSummary]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="fp8rl-report-") as tmp:
        for metric, name in PLOTS.items():
            lines = {f"{r.recipe} ({r.run_name})": r.histories[metric] for r in runs if r.histories.get(metric)}
            if lines:
                out[name] = plot_metric_history(lines, metric, Path(tmp) / name).read_bytes()
    return out


_STYLE = (
    "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}"
    "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child{text-align:left}"
    "img{max-width:48%;margin:4px}pre{background:#f6f6f6;padding:8px;overflow-x:auto}"
)


def build_comparison_report(
    experiment: str,
    parent_run_id: str,
    tracking_uri: str,
    run_ids: Sequence[str] | None = None,
    title: str = "Recipe comparison",
    context: Sequence[str] = (),
    appendix_markdown: str = "",
) -> ComparisonReport:
    """Read the recipe runs under ``parent_run_id`` and build the report.

    ``run_ids`` (when given) must all be among them, and only they are reported: a pipeline
    passes the runs its steps created, so a missing one is an error, not a shorter table.
    ``context`` lines (e.g. the KFP run) go under the title; ``appendix_markdown`` (e.g. the FP8
    conversion report) at the end.
    """
    runs = _recipe_runs(experiment, parent_run_id, tracking_uri, run_ids)
    table = markdown_table(runs)
    plots = _plots(runs)
    where = [
        f"MLflow experiment `{experiment}`, comparison run `{parent_run_id}` at `{tracking_uri}`; "
        f"its recipe runs: `tags.mlflow.parentRunId = '{parent_run_id}'`.",
        *context,
    ]
    md = [f"# {title}", "", *(f"- {line}" for line in where), "", table]
    if plots:
        md += [
            "",
            "Plots (reward, held-out accuracy, token_mult_prob_error over steps): "
            + ", ".join(f"`plots/{n}`" for n in plots)
            + " in the comparison run's artifacts.",
            "",
        ]
    if appendix_markdown:
        md += ["", appendix_markdown.strip(), ""]
    page = _html_page(title, where, runs, plots, appendix_markdown)
    return ComparisonReport(table=table, markdown="\n".join(md).rstrip() + "\n", html=page, plots=plots, runs=runs)


def _recipe_runs(
    experiment: str, parent_run_id: str, tracking_uri: str, run_ids: Sequence[str] | None
) -> list[RunSummary]:  # fmt: skip
    """The recipe runs under ``parent_run_id`` with the report's metrics; only ``run_ids`` when given, each of which
    must be there."""
    metrics = sorted({m for _, m, _ in COLUMNS} | set(PLOTS))
    runs = fetch_recipe_runs(experiment, parent_run_id, tracking_uri, metrics)
    if run_ids is not None:
        found = {r.run_id for r in runs}
        missing = [i for i in run_ids if i not in found]
        if missing:
            raise UserError(
                f"MLflow runs {missing} are not recipe runs under comparison run {parent_run_id} "
                f"in experiment {experiment!r} at {tracking_uri}"
            )
        wanted = set(run_ids)
        runs = [r for r in runs if r.run_id in wanted]
    if not runs:
        raise UserError(f"no recipe runs under comparison run {parent_run_id} in experiment {experiment!r}")
    return runs


def _html_page(
    title: str, where: Sequence[str], runs: Sequence[RunSummary], plots: dict[str, bytes], appendix_markdown: str
) -> str:  # fmt: skip
    """The self-contained page: every value escaped, the plots inlined as PNG data URIs."""
    images = "".join(
        f'<img alt="{html.escape(n)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        for n, png in plots.items()
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1><ul>"
        + "".join(f"<li>{html.escape(line)}</li>" for line in where)
        + f"</ul>{_html_table(runs)}<div>{images}</div>"
        + (f"<pre>{html.escape(appendix_markdown)}</pre>" if appendix_markdown else "")
        + "</body></html>\n"
    )
