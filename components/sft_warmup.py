"""Supervised warm-up of the tiny model on the synthetic arithmetic task, so RL starts from non-trivial accuracy."""

from kfp import dsl
from kfp.dsl import Input, Metrics, Model, Output

from components.images import COMPONENT_IMAGE


@dsl.component(base_image=COMPONENT_IMAGE, install_kfp_package=False)
def sft_warmup(base_model: Input[Model], steps: int, model: Output[Model], metrics: Output[Metrics]) -> None:
    """``steps`` SFT steps from ``base_model`` (``fp8rl.train.sft``); ``steps=0`` passes the model through
    unchanged (an imported checkpoint, or a task of your own)."""
    import shutil

    from components.runtime import log_kfp_metrics
    from fp8rl.errors import UserError
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
    result = warm_up(model.path, opts, overwrite=True)
    model.metadata.update({**base_model.metadata, "sft_steps": steps})
    log_kfp_metrics(metrics, {f"sft/{k}": v for k, v in result.items()})
