"""FP8 checkpoint conversion with a recipe's scaling: the FP8 Model artifact and its error report."""

from kfp import dsl
from kfp.dsl import Input, Markdown, Model, Output

from components.images import COMPONENT_IMAGE


@dsl.component(base_image=COMPONENT_IMAGE, install_kfp_package=False)
def convert_to_fp8(model: Input[Model], recipe: str, fp8_model: Output[Model], report: Output[Markdown]) -> None:
    """Convert ``model`` to the FP8 checkpoint that ``recipe``'s rollout serves (granularity, power-of-two scales,
    BF16 first/last layers from the recipe's ``quant``); ``report`` is the per-tensor error report."""
    import shutil
    from pathlib import Path

    from fp8rl.checkpoint import REPORT_MD, ConvertOptions, convert_checkpoint
    from fp8rl.config import load_recipe

    opts = ConvertOptions(load_recipe(recipe).quant)
    convert_checkpoint(model.path, fp8_model.path, opts, overwrite=True, show_progress=False)
    shutil.copyfile(Path(fp8_model.path) / REPORT_MD, report.path)
    fp8_model.metadata.update({**model.metadata, "recipe": recipe, "granularity": opts.quant.granularity})
