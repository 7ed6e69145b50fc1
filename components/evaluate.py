"""Held-out evaluation of a trained checkpoint with the rollout engine, under the recipe's rollout numerics."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Metrics, Model, Output

from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def evaluate(
    model: Input[Model],
    mlflow_run: Input[Artifact],
    run_id: str,
    recipe: str,
    seed: int,
    run_config: dict,
    metrics: Output[Metrics],
    device: str = "auto",
) -> None:
    """Greedy and sampled held-out accuracy and response statistics (``fp8rl.evaluation.checkpoint``), logged to the
    recipe's MLflow run ``run_id`` as ``evaluate/*`` (with the system metrics of the evaluation) and to ``metrics``."""
    from components.runtime import log_kfp_metrics, read_run_ref, recipe_run, runs_fail_with_the_step
    from components.runtime import run_config as make_config
    from fp8rl.evaluation.checkpoint import evaluate_checkpoint

    ref = read_run_ref(mlflow_run)
    cfg = make_config(recipe, 1, seed, run_config, ref)
    with (
        recipe_run(ref, run_id, recipe, seed, {}, cfg.tracking) as run,
        runs_fail_with_the_step(ref, "evaluate", recipe, seed),
    ):
        results = evaluate_checkpoint(cfg, model.path, device)
        run.log_metrics(results, step=0)
    log_kfp_metrics(metrics, results)
    print(", ".join(f"{k} {v:.4f}" for k, v in results.items()))
