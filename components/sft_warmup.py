"""Supervised warm-up of the tiny model on the synthetic arithmetic task, so RL starts from non-trivial accuracy."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Metrics, Model, Output

from components.images import COMPONENT_IMAGE


@dsl.component(base_image=COMPONENT_IMAGE, install_kfp_package=False)
def sft_warmup(
    base_model: Input[Model],
    steps: int,
    mlflow_run: Input[Artifact],
    pipeline_name: str,
    kfp_run_id: str,
    model: Output[Model],
    metrics: Output[Metrics],
) -> None:
    """``steps`` SFT steps from ``base_model`` (``fp8rl.train.sft``), as the MLflow run ``sft-warmup`` under the
    comparison run (options, loss, held-out accuracy, datasets, versions; no ``recipe`` tag, so no recipe row);
    ``steps=0`` passes the model through unchanged (an imported checkpoint, or a task of your own) and starts no
    run."""
    import shutil

    from components.runtime import TAG_KFP_COMPONENT, kfp_tags, log_kfp_metrics, read_run_ref
    from fp8rl.errors import UserError
    from fp8rl.provenance import provenance_tags
    from fp8rl.tracking import MlflowSink
    from fp8rl.train.sft import SFTOptions
    from fp8rl.train.sft import sft_warmup as warm_up

    if steps == 0:
        shutil.copytree(base_model.path, model.path, dirs_exist_ok=True)
        model.metadata.update({**base_model.metadata, "sft_steps": 0})
        return
    if "preset" not in base_model.metadata:
        raise UserError(
            f"sft_steps={steps}: the SFT warm-up trains the tiny models only; set sft_steps=0 for "
            f"{base_model.metadata.get('source', base_model.path)}"
        )
    # sft_warmup builds its starting weights from (preset, seed): the same ones prepare_model saved.
    opts = SFTOptions(preset=base_model.metadata["preset"], seed=int(base_model.metadata["seed"]), steps=steps)
    ref = read_run_ref(mlflow_run)
    tags = kfp_tags(pipeline_name, kfp_run_id, "sft-warmup")
    with MlflowSink(ref.experiment, tags[TAG_KFP_COMPONENT], ref.work_dir, ref.run_id, tags) as sink:
        sink.set_tags({**provenance_tags(), "fp8rl.checkpoint_uri": model.path})
        result = warm_up(model.path, opts, overwrite=True, sink=sink)
    model.metadata.update({**base_model.metadata, "sft_steps": steps, "sft_mlflow_run_id": sink.run_id})
    log_kfp_metrics(metrics, {f"sft/{k}": v for k, v in result.items()})
