"""The RL step of one recipe: RL from a checkpoint, tracked as a child MLflow run; the trained checkpoint out."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Metrics, Model, Output

from components.images import COMPONENT_IMAGE


# rayjob_template's default is where the pipelines mount the chart's ConfigMap <release>-fp8rl-rayjob-defaults
# (pipelines.cluster.RAYJOB_DEFAULTS_MOUNT), written out: KFP ships the function's source alone, so a default
# must be a literal (tests/unit/test_pipelines.py checks that the two agree).
@dsl.component(base_image=COMPONENT_IMAGE, install_kfp_package=False)
def rl_step(
    model: Input[Model],
    mlflow_run: Input[Artifact],
    recipe: str,
    steps: int,
    seed: int,
    run_config: dict,
    pipeline_name: str,
    kfp_run_id: str,
    trained: Output[Model],
    metrics: Output[Metrics],
    backend: str = "local",
    rayjob_template: str = "/etc/fp8rl/rayjob.yaml",
    timeout_s: float = 86400.0,
) -> str:
    """``steps`` RL steps of ``recipe`` (``run_config``: further RunConfig fields) from ``model``; returns the
    recipe's MLflow run id. ``backend``: ``local`` runs the loop on Ray from this process -- a local Ray
    it starts and stops, or the cluster ``$RAY_ADDRESS`` / ``run_config.ray.address`` names; ``process`` runs
    it in this process without Ray (on one GPU: the vLLM engine beside the trainer); ``rayjob`` runs
    ``fp8rl train`` as a KubeRay RayJob (template ``rayjob_template``) and waits for it."""
    from components.runtime import (
        check_backend,
        kfp_tags,
        log_kfp_metrics,
        read_run_ref,
        rl_step_config,
        run_metrics,
        runs_fail_with_the_step,
    )

    check_backend(backend)
    ref = read_run_ref(mlflow_run)
    cfg = rl_step_config(backend, recipe, steps, seed, run_config, ref)
    tags = kfp_tags(pipeline_name, kfp_run_id, "rl-step")
    with runs_fail_with_the_step(ref, "rl-step", recipe, seed):
        if backend in ("local", "process"):
            from fp8rl.experiment import tracked_run

            run = tracked_run(cfg, model.path, parent_run_id=ref.run_id, output_dir=trained.path, tags=tags)
            run_id = run.run_id
        else:
            from fp8rl.kube.rl_step import run_rl_step_as_rayjob

            run_id = run_rl_step_as_rayjob(cfg, model.path, trained.path, ref.run_id, tags, rayjob_template, timeout_s)
    log_kfp_metrics(metrics, run_metrics(run_id, ref.work_dir, prefix="summary/"))
    trained.metadata.update({**model.metadata, "recipe": recipe, "mlflow_run_id": run_id})
    return run_id
