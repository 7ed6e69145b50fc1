"""The accuracy study's report: the runs read back from MLflow, per recipe held-out accuracy at step 0 and at the end
(mean and sample std over the seeds), the run-mean mismatch metrics, the FP8 linear counts, the published claims
checked (``check_targets``), the curves and table logged on the parent run, and one JSON record per run
(``study_report``).  The runs themselves: ``fp8rl.accuracy.study``.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fp8rl.accuracy.study import ACCURACY, MISMATCH_METRICS, run_name
from fp8rl.atomic import atomic_write_text
from fp8rl.errors import UserError

# the recipe names the targets compare (as docs/configs/accuracy names them)
BF16, ROLLOUT_NO_IS, ROLLOUT_TIS, E2E_PREFIX = "bf16", "fp8-rollout-no-is", "fp8-rollout", "fp8-e2e"


@dataclass(frozen=True)
class RunRecord:
    """One run of the study, as ``docs/results/accuracy-<model>.json`` holds it."""

    recipe: str
    seed: int
    steps: int
    accuracy_start: float
    accuracy_end: float
    token_mult_prob_error: float
    gen_kl: float
    policy_kl: float
    fp8_linears_engine: int
    fp8_linears_trainer: int
    status: str
    run_id: str


@dataclass(frozen=True)
class RecipeSummary:
    recipe: str
    seeds: list[int]
    steps: int
    accuracy_start: tuple[float, float]  # (mean, std over seeds)
    accuracy_end: tuple[float, float]
    token_mult_prob_error: float  # mean over seeds of the run means
    gen_kl: float
    fp8_linears_engine: int
    fp8_linears_trainer: int
    accuracy_end_range: tuple[float, float] = (math.nan, math.nan)  # (lowest, highest seed)

    @property
    def gain(self) -> float:
        return self.accuracy_end[0] - self.accuracy_start[0]


@dataclass
class Target:
    claim: str
    held: bool | None  # None: not measurable here (a recipe missing, no gap to close)
    detail: str


@dataclass
class StudyReport:
    records: list[RunRecord]
    summaries: list[RecipeSummary]
    targets: list[Target] = field(default_factory=list)
    parent_run_id: str = ""

    def markdown(self) -> str:
        bf16_ends = [r.accuracy_end for r in self.records if r.recipe == BF16]
        return summary_table(self.summaries, bf16_ends) + "\n" + targets_table(self.targets)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _run_mean(history: Sequence[tuple[int, float]]) -> float:
    return math.fsum(v for _, v in history) / len(history) if history else float("nan")


def run_record(
    recipe: str,
    seed: int,
    status: str,
    run_id: str,
    params: Mapping[str, str],
    histories: Mapping[str, Sequence[tuple[int, float]]],
    at_step: int | None = None,
) -> RunRecord:
    """A run's record from its MLflow params and metric histories (``{metric: [(step, value), ...]}``), up to
    ``at_step`` (default: its last step): accuracy at step 0 and at the last evaluation up to it, mismatch metrics
    averaged over its steps up to it."""
    limit = math.inf if at_step is None else at_step
    acc = sorted((s, v) for s, v in histories.get(ACCURACY, []) if s <= limit)
    if not acc or acc[0][0] != 0:
        raise UserError(f"run {run_name(recipe, seed)} ({run_id}) has no step-0 {ACCURACY}: it never started")
    steps = max((s for s, _ in histories.get("time/step_s", [])), default=0)
    tmpe, gen_kl, policy_kl = (_run_mean([p for p in histories.get(m, []) if p[0] <= limit]) for m in MISMATCH_METRICS)
    return RunRecord(
        recipe=recipe, seed=seed, steps=acc[-1][0], accuracy_start=acc[0][1], accuracy_end=acc[-1][1],
        token_mult_prob_error=tmpe, gen_kl=gen_kl, policy_kl=policy_kl,
        fp8_linears_engine=int(params.get("fp8_linears_engine", 0)),
        fp8_linears_trainer=int(params.get("fp8_linears_trainer", 0)),
        status=status if steps == acc[-1][0] else f"{status} (compared at step {acc[-1][0]} of {steps})",
        run_id=run_id,
    )  # fmt: skip


def common_eval_step(histories: Sequence[Mapping[str, Sequence[tuple[int, float]]]]) -> int:
    """The last step at which every run was evaluated: runs cut short by a budget are compared there."""
    steps = [{s for s, _ in h.get(ACCURACY, [])} for h in histories]
    shared = set.intersection(*steps) if steps else set()
    return max(shared, default=0)


def summarize(records: Sequence[RunRecord]) -> list[RecipeSummary]:
    """Per recipe (in first-seen order): accuracy at step 0 and at the end, mean and sample std over the seeds."""
    by_recipe: dict[str, list[RunRecord]] = {}
    for r in records:
        by_recipe.setdefault(r.recipe, []).append(r)
    out = []
    for recipe, rs in by_recipe.items():
        out.append(
            RecipeSummary(
                recipe=recipe, seeds=sorted(r.seed for r in rs), steps=min(r.steps for r in rs),
                accuracy_start=_mean_std([r.accuracy_start for r in rs]),
                accuracy_end=_mean_std([r.accuracy_end for r in rs]),
                token_mult_prob_error=statistics.fmean(r.token_mult_prob_error for r in rs),
                gen_kl=statistics.fmean(r.gen_kl for r in rs),
                fp8_linears_engine=max(r.fp8_linears_engine for r in rs),
                fp8_linears_trainer=max(r.fp8_linears_trainer for r in rs),
                accuracy_end_range=(min(r.accuracy_end for r in rs), max(r.accuracy_end for r in rs)),
            )
        )  # fmt: skip
    return out


PARITY_TOLERANCE = 0.01  # how far under BF16's mean final accuracy still counts as parity (1 point)


def at_parity(end: float, bf16_ends: Sequence[float], tolerance: float = PARITY_TOLERANCE) -> bool:
    """A recipe's mean final accuracy ``end`` is at BF16's level: inside the BF16 seeds' range, or at most
    ``tolerance`` under their mean (over it counts as parity too)."""
    return min(bf16_ends) <= end <= max(bf16_ends) or end >= statistics.fmean(bf16_ends) - tolerance


def parity_verdict(end: float, bf16_ends: Sequence[float], tolerance: float = PARITY_TOLERANCE) -> str:
    """What a user reads for an FP8 recipe: "at parity", or "N points under BF16 (outside the seeds' spread)"."""
    if at_parity(end, bf16_ends, tolerance):
        return "at parity"
    under = (statistics.fmean(bf16_ends) - end) * 100
    return f"{under:.1f} points under BF16 (outside the seeds' spread)"


def check_targets(records: Sequence[RunRecord], min_gain: float = 0.10, e2e_tolerance: float = 0.01) -> list[Target]:
    """The published claims, against this study's runs (``held`` None where a recipe they compare is missing):

    1. BF16 improves held-out accuracy by at least ``min_gain`` over step 0 (mean over seeds).
    2. Each ``fp8-e2e*`` recipe ends within the BF16 seeds' range, or at most ``e2e_tolerance`` below their mean.
    3. Mismatch (run-mean token_mult_prob_error) orders bf16 < fp8-e2e < fp8-rollout without correction.
    4. Token TIS closes at least half of the gap in final accuracy between fp8-rollout without correction and bf16,
       if there is one: a gap no larger than either recipe's std over seeds is no gap.
    """
    by: dict[str, list[RunRecord]] = {}
    for r in records:
        by.setdefault(r.recipe, []).append(r)
    targets: list[Target] = []
    end = {k: statistics.fmean(r.accuracy_end for r in v) for k, v in by.items()}
    tmpe = {k: statistics.fmean(r.token_mult_prob_error for r in v) for k, v in by.items()}
    if BF16 in by:
        gain = end[BF16] - statistics.fmean(r.accuracy_start for r in by[BF16])
        targets.append(Target(f"bf16 improves >= {min_gain:.2f} over step 0", gain >= min_gain, f"gain {gain:+.3f}"))
    e2e = [k for k in by if k.startswith(E2E_PREFIX)]
    targets += [_e2e_accuracy_target(k, by, end, e2e_tolerance) for k in e2e]
    if BF16 in by and ROLLOUT_NO_IS in by:
        for k in e2e:
            ok = tmpe[BF16] < tmpe[k] < tmpe[ROLLOUT_NO_IS]
            detail = f"{tmpe[BF16]:.4f} < {tmpe[k]:.4f} < {tmpe[ROLLOUT_NO_IS]:.4f}"
            targets.append(Target(f"token_mult_prob_error bf16 < {k} < {ROLLOUT_NO_IS}", ok, detail))
    if {BF16, ROLLOUT_NO_IS, ROLLOUT_TIS} <= by.keys():
        targets.append(_tis_target(by, end))
    return targets


def _e2e_accuracy_target(k: str, by: dict[str, list[RunRecord]], end: dict[str, float], e2e_tolerance: float) -> Target:
    """Target 2 of ``check_targets`` for the ``fp8-e2e*`` recipe ``k``."""
    if BF16 not in by:
        return Target(f"{k} final accuracy matches bf16", None, "no bf16 runs")
    steps, bf16_steps = min(r.steps for r in by[k]), min(r.steps for r in by[BF16])
    if steps < bf16_steps:
        detail = f"stopped at step {steps}, bf16 evaluated at step {bf16_steps}: not comparable"
        return Target(f"{k} final accuracy matches bf16", None, detail)
    lo, hi = min(r.accuracy_end for r in by[BF16]), max(r.accuracy_end for r in by[BF16])
    ok = at_parity(end[k], [r.accuracy_end for r in by[BF16]], e2e_tolerance)
    detail = f"{end[k]:.3f} vs bf16 {end[BF16]:.3f} (seeds {lo:.3f}..{hi:.3f})"
    return Target(f"{k} final within bf16's spread or <= {e2e_tolerance:.2f} below", ok, detail)


def _tis_target(by: dict[str, list[RunRecord]], end: dict[str, float]) -> Target:
    """Target 4 of ``check_targets``: how much of the fp8-rollout-without-correction gap token TIS closes."""
    gap = end[BF16] - end[ROLLOUT_NO_IS]
    noise = max(_mean_std([r.accuracy_end for r in by[k]])[1] for k in (BF16, ROLLOUT_NO_IS))
    if 0 < gap <= noise:
        detail = f"gap {gap:.3f} is within the seeds' spread (std up to {noise:.3f}): no gap to close"
        return Target("token TIS closes >= half the gap", None, detail)
    if gap <= 0:
        return Target("token TIS closes >= half the gap", None, f"no gap: {ROLLOUT_NO_IS} - bf16 = {-gap:+.3f}")
    closed = (end[ROLLOUT_TIS] - end[ROLLOUT_NO_IS]) / gap
    return Target("token TIS closes >= half the gap", closed >= 0.5, f"closes {closed:.0%} of {gap:.3f}")


def _pm(ms: tuple[float, float]) -> str:
    return f"{ms[0]:.3f} ± {ms[1]:.3f}"


def summary_table(summaries: Sequence[RecipeSummary], bf16_ends: Sequence[float] = ()) -> str:
    """The per-recipe table; with the BF16 runs' final accuracies (``bf16_ends``, one a seed) each other recipe's
    verdict against them (``parity_verdict``)."""
    head = ("| recipe | seeds | steps | FP8 linears (engine / trainer) | held-out accuracy, step 0 | at the end | gain "
            "| vs bf16 | token_mult_prob_error | gen_kl |")  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        verdict = "-" if s.recipe == BF16 or not bf16_ends else parity_verdict(s.accuracy_end[0], bf16_ends)
        lines.append(
            f"| {s.recipe} | {','.join(map(str, s.seeds))} | {s.steps} | {s.fp8_linears_engine} / "
            f"{s.fp8_linears_trainer} | {_pm(s.accuracy_start)} | {_pm(s.accuracy_end)} | {s.gain:+.3f} | {verdict} | "
            f"{s.token_mult_prob_error:.4f} | {s.gen_kl:.2e} |"
        )
    return "\n".join(lines) + "\n"


def targets_table(targets: Sequence[Target]) -> str:
    lines = ["| target | held | measured |", "|---|---|---|"]
    for t in targets:
        held = {True: "yes", False: "no", None: "n/a"}[t.held]
        lines.append(f"| {t.claim} | {held} | {t.detail} |")
    return "\n".join(lines) + "\n"


def fetch_records(experiment: str, parent_run_id: str, work_dir: str | Path) -> tuple[list[RunRecord], dict[str, Any]]:
    """Every child run of ``parent_run_id`` as a record (sorted by recipe, then seed), compared at the last step at
    which all finished runs were evaluated (``common_eval_step``; a run stopped earlier is recorded at its last
    evaluation, and ``check_targets`` does not compare its accuracy), and its metric histories by run name."""
    from mlflow import MlflowClient

    from fp8rl.tracking import configure_mlflow, fetch_recipe_runs

    uri = configure_mlflow(work_dir)
    runs = fetch_recipe_runs(experiment, parent_run_id, uri, [ACCURACY, "time/step_s", *MISMATCH_METRICS])
    if not runs:
        raise UserError(f"parent run {parent_run_id}: no recipe runs under it in experiment {experiment!r}")
    client = MlflowClient(tracking_uri=uri)
    finished = [s.histories for s in runs if s.status == "FINISHED"]  # runs a budget stopped do not hold the rest back
    at_step = common_eval_step(finished or [s.histories for s in runs])
    records, histories = [], {}
    for s in sorted(runs, key=lambda s: s.start_time_ms):
        run = client.get_run(s.run_id)
        seed = int(run.data.tags.get("seed", run.data.params.get("seed", 0)))
        records.append(run_record(s.recipe, seed, s.status, s.run_id, run.data.params, s.histories, at_step))
        histories[run_name(s.recipe, seed)] = s.histories
    return sorted(records, key=lambda r: (r.recipe, r.seed)), histories


def recipe_curves(
    records: Sequence[RunRecord], histories: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]], metric: str
) -> dict[str, list[tuple[int, float]]]:
    """``metric`` per recipe, the mean over its seeds at every step all of them logged."""
    by: dict[str, list[Mapping[int, float]]] = {}
    for r in records:
        by.setdefault(r.recipe, []).append(dict(histories[run_name(r.recipe, r.seed)].get(metric, [])))
    out = {}
    for recipe, seeds in by.items():
        steps = sorted(set.intersection(*(set(h) for h in seeds)))
        out[recipe] = [(s, statistics.fmean(h[s] for h in seeds)) for s in steps]
    return out


def study_report(
    experiment: str, parent_run_id: str, work_dir: str | Path, json_path: str | Path | None = None
) -> StudyReport:
    """Read the study's runs, summarize them, check the targets; log the curves, the table and the records on the
    parent run (``plots/``, ``accuracy.md``, ``accuracy.json``); write the records to ``json_path`` when given."""
    import json

    from fp8rl.tracking import MlflowSink, plot_metric_history

    records, histories = fetch_records(experiment, parent_run_id, work_dir)
    report = StudyReport(records, summarize(records), check_targets(records), parent_run_id)
    rows = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(r).items()} for r in records]
    payload = json.dumps(rows, indent=1) + "\n"  # strict JSON: a metric never logged is null, not NaN
    with MlflowSink.attach(parent_run_id, work_dir) as parent, tempfile.TemporaryDirectory() as tmp:
        plots = Path(tmp) / "plots"
        plots.mkdir()
        for metric in (ACCURACY, *MISMATCH_METRICS):
            curves = {k: v for k, v in recipe_curves(records, histories, metric).items() if v}
            if curves:
                plot_metric_history(curves, f"{metric} (mean over seeds)", plots / f"{metric.split('/')[-1]}.png")
        parent.log_artifact(plots, "plots")
        (Path(tmp) / "accuracy.md").write_text(report.markdown())
        (Path(tmp) / "accuracy.json").write_text(payload)
        parent.log_artifact(Path(tmp) / "accuracy.md")
        parent.log_artifact(Path(tmp) / "accuracy.json")
        parent.log_metrics(
            {f"accuracy_end/{s.recipe}": s.accuracy_end[0] for s in report.summaries}
            | {f"token_mult_prob_error/{s.recipe}": s.token_mult_prob_error for s in report.summaries},
            step=max(r.steps for r in records),
        )
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(json_path), payload)
    return report
