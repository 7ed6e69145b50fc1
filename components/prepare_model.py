"""Prepare the starting checkpoint: a tiny model made from a preset, or an imported Hugging Face checkpoint."""

from kfp import dsl
from kfp.dsl import Model, Output

from components.images import COMPONENT_IMAGE


@dsl.component(base_image=COMPONENT_IMAGE, install_kfp_package=False)
def prepare_model(source: str, seed: int, model: Output[Model]) -> None:
    """``source``: a tiny preset (``tiny``, ``small``, ``tiny-odd``; no download), a checkpoint directory
    (e.g. on a mounted volume: ``/data/models/Qwen3-0.6B``), ``file://<dir>``, or ``hf://<org>/<name>[@<revision>]``
    (Hugging Face Hub, token from ``$HF_TOKEN``). The model's origin is recorded in the artifact's metadata."""
    from fp8rl.models import import_model

    model.metadata.update(import_model(source, model.path, seed=seed, overwrite=True))
