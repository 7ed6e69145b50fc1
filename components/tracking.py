"""Start the pipeline run's MLflow comparison run (the parent of one run per recipe)."""

from kfp import dsl
from kfp.dsl import Artifact, Output

from components.images import COMPONENT_IMAGE


@dsl.component(base_image=COMPONENT_IMAGE, install_kfp_package=False)
def start_tracking(
    experiment: str,
    work_dir: str,
    pipeline_name: str,
    kfp_run_id: str,
    kfp_run_name: str,
    mlflow_run: Output[Artifact],
) -> None:
    """Create the comparison run, tagged with the KFP run, and pass its reference on as ``mlflow_run``.

    The run stays RUNNING until the recipe-comparison step ends it. The tracking store is
    ``$MLFLOW_TRACKING_URI`` (a server, on a cluster) or ``<work_dir>/mlflow.db``.
    """
    from components.runtime import MlflowRunRef, kfp_tags, write_run_ref
    from fp8rl.tracking import configure_mlflow, start_parent_run

    tags = {**kfp_tags(pipeline_name, kfp_run_id, "start-tracking", kfp_run_name), "fp8rl.comparison": "true"}
    run_id = start_parent_run(experiment, f"{pipeline_name}-{kfp_run_id[:8]}", work_dir, tags)
    write_run_ref(mlflow_run, MlflowRunRef(run_id, experiment, work_dir, configure_mlflow(work_dir)))
    print(f"MLflow comparison run {run_id} in experiment {experiment!r}")


@dsl.component(base_image=COMPONENT_IMAGE, install_kfp_package=False)
def finish_tracking(experiment: str, work_dir: str, kfp_run_id: str, status: dsl.PipelineTaskFinalStatus) -> None:
    """The pipeline's exit task: it runs however the run ends (success, a failed step, a step's pod killed
    outright) and ends every MLflow run of this KFP run that is still RUNNING as the pipeline ended: FINISHED,
    FAILED or KILLED (``components.runtime.end_kfp_run_runs``)."""
    from components.runtime import end_kfp_run_runs

    error = f"{status.pipeline_task_name}: {status.error_message}" if status.error_message else ""
    end_kfp_run_runs(work_dir, experiment, kfp_run_id, status.state, error)
