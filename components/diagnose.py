"""FP8 mismatch diagnosis before RL: which decoder layers carry a recipe's FP8 disagreement, and which to keep BF16."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Markdown, Model, Output

from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def diagnose_mismatch(
    model: Input[Model],
    recipe: str,
    run_config: dict,
    report: Output[Markdown],
    diagnosis: Output[Artifact],
    target: float = 1.02,
    examples: int = 64,
    device: str = "auto",
) -> None:
    """``fp8rl diagnose`` on ``model``: per-layer token_mult_prob_error of ``recipe``'s FP8 rollout against BF16,
    and the smallest ``bf16_first_layers`` / ``bf16_last_layers`` under ``target``; ``report`` is the Markdown,
    ``diagnosis`` the directory with the JSON and the plot."""
    import shutil
    from pathlib import Path

    from fp8rl.config import load_recipe, parse_run_config
    from fp8rl.devices import resolve_device
    from fp8rl.diagnose import diagnose_run

    cfg = parse_run_config({**run_config, "recipe": load_recipe(recipe).model_dump()}, "run_config")
    dev = resolve_device(device, "device")
    diag = diagnose_run(cfg, model.path, diagnosis.path, target, examples, device=dev)
    shutil.copyfile(Path(diagnosis.path) / "diagnosis.md", report.path)
    rec = diag.recommendation
    diagnosis.metadata.update({"recipe": recipe, "tmpe_all_fp8": diag.tmpe_all_fp8, "target": target,
                               **({"bf16_first_layers": rec["first"], "bf16_last_layers": rec["last"]} if rec else {})})  # fmt: skip
