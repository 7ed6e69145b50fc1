"""KFP v2 components: one file per pipeline stage, each a thin wrapper that calls into ``fp8rl``.

Every component is a lightweight Python component (``@dsl.component``), so the same definition
runs on Kubeflow Pipelines (in the project's images, ``components.images``) and under
``kfp.local.SubprocessRunner`` (in the current environment). Component bodies import what they
use inside the function (KFP ships only the function's source); what several bodies share lives
in ``components.runtime``, imported from the installed ``components`` package. Kubernetes
settings (GPUs, tolerations, volumes, Secrets) are not here: the pipelines add them per task
with ``kfp.kubernetes``, and kfp.local ignores them.
"""

from __future__ import annotations

from typing import Any


def all_components() -> dict[str, Any]:
    """``{name: component}`` of every component, by its KFP name (``rl-step``); imports kfp and each module.
    ``python -m pipelines.compile --components`` writes each as a YAML other pipelines can load
    (``kfp.components.load_component_from_file``)."""
    from components.benchmark import benchmark, benchmark_model, benchmark_recipes
    from components.compare import compare_recipes, comparison_runs
    from components.convert import convert_to_fp8
    from components.diagnose import diagnose_mismatch
    from components.evaluate import evaluate
    from components.prepare_model import prepare_model
    from components.rl_step import rl_step
    from components.sft_warmup import sft_warmup
    from components.tracking import finish_tracking, start_tracking

    found = [start_tracking, prepare_model, sft_warmup, convert_to_fp8, diagnose_mismatch, comparison_runs, rl_step, evaluate,
             benchmark_model, benchmark_recipes, benchmark, compare_recipes, finish_tracking]  # fmt: skip
    return {c.name.replace("_", "-"): c for c in found}
