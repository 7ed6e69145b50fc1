"""Recipe comparison: read the recipe runs back from MLflow and write the report (Markdown and HTML)."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Input, Markdown, Output

from components.images import COMPONENT_IMAGE


@dsl.component(base_image=COMPONENT_IMAGE, install_kfp_package=False)
def comparison_runs(recipes: list, seeds: list, seed: int) -> list:
    """The runs of a comparison: every recipe with every seed of ``seeds`` (empty: ``seed`` alone), as
    ``{"recipe": ..., "seed": ...}`` items, recipe by recipe (one list output, which a ParallelFor iterates)."""
    from fp8rl.errors import UserError

    if not recipes:
        raise UserError("recipes: the comparison needs at least one recipe")
    runs = [{"recipe": str(r), "seed": int(s)} for r in recipes for s in (seeds or [seed])]
    if len({(r["recipe"], r["seed"]) for r in runs}) < len(runs):
        raise UserError(f"recipes {recipes} with seeds {seeds or [seed]}: a recipe or a seed is given twice")
    return runs


@dsl.component(base_image=COMPONENT_IMAGE, install_kfp_package=False)
def compare_recipes(
    mlflow_run: Input[Artifact],
    run_ids: list,
    conversion_report: Input[Markdown],
    pipeline_name: str,
    kfp_run_id: str,
    report: Output[Markdown],
    report_html: Output[HTML],
) -> None:
    """Table of final accuracy, mismatch and throughput per recipe, with plots (``fp8rl.bench.report``), for the
    runs ``run_ids`` (empty: every recipe run under the comparison run); the FP8 conversion report is appended.
    The best recipe's trained checkpoint (``fp8rl.tracking.models.register_champion``) becomes a version of the
    registered model ``fp8rl-<task>`` with alias ``champion`` (when the runs logged models: not in a benchmark).
    The report is logged to the comparison run, which then ends FINISHED (FAILED if this step fails), unless a
    failed step ended it before: that status stays."""
    import tempfile
    from pathlib import Path

    from components.runtime import read_run_ref
    from fp8rl.atomic import atomic_write_text
    from fp8rl.bench.report import build_comparison_report
    from fp8rl.tracking import MlflowSink
    from fp8rl.tracking.models import register_champion

    ref = read_run_ref(mlflow_run)
    with MlflowSink.attach(ref.run_id, ref.work_dir, keep_ended=True) as parent:
        result = build_comparison_report(
            ref.experiment, ref.run_id, parent.tracking_uri, list(run_ids) or None, title=f"{pipeline_name}: recipes",
            context=[f"KFP pipeline `{pipeline_name}`, run `{kfp_run_id}`."],
            appendix_markdown=Path(conversion_report.path).read_text(),
        )  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="fp8rl-report-") as tmp:
            parent.log_artifact(result.write(tmp))
        champion = register_champion(parent.tracking_uri, ref.run_id, list(run_ids) or None)
    report.metadata.update({"table": result.table, "mlflow_run_id": ref.run_id, "tracking_uri": ref.tracking_uri})
    atomic_write_text(report.path, result.markdown)
    atomic_write_text(report_html.path, result.html)
    print(result.table)
    if champion is not None:
        report.metadata.update({"champion": champion.uri, "champion_recipe": champion.recipe})
        print(champion.how_to_load(ref.tracking_uri))
