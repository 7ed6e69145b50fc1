"""``recipe-comparison``: prepare -> SFT warm-up -> FP8 conversion [-> mismatch diagnosis] -> per recipe (RL step ->
evaluate -> benchmark) -> compare.

Every recipe starts from the same warmed-up checkpoint and is one child MLflow run of one comparison run. Parameters:
- ``seed``: the model's initial weights (a tiny preset), the SFT warm-up and, without ``seeds``, the RL run.
- ``seeds``: every recipe runs once per seed (its own RL step, evaluation and benchmark, its own MLflow run).
- ``run_config``: further RunConfig fields for every recipe (e.g. ``{"grpo": {"prompts_per_step": 8}}``).
- ``backend``: ``rayjob`` (a KubeRay RayJob per RL step) or ``local`` (in the step's process).
- ``diagnose``: first attribute ``convert_recipe``'s FP8 mismatch to layers on the warmed-up model and recommend the
  BF16 layers that bring it under ``diagnose_target`` (``fp8rl diagnose``).  It runs beside the RL steps (KFP lets
  no task outside a condition wait on one inside it); its report is advisory.
"""

from typing import Any

from kfp import dsl

from fp8rl.config import CORE_RECIPES
from pipelines import stages
from pipelines.cluster import (
    CLUSTER_WORK_DIR,
    DEFAULT_HF_SECRET,
    DEFAULT_MLFLOW_SECRET,
    DEFAULT_PVC,
    DEFAULT_RAYJOB_DEFAULTS,
    DEFAULT_RETRIES,
    NO_STEP_PODS,
    STEP_SIZES,
    ClusterRefs,
    StepPods,
    StepSize,
)

NAME = "recipe-comparison"


def build(
    parallelism: int = 0, retries: int = DEFAULT_RETRIES, medium: StepSize = STEP_SIZES["medium"], gpus: bool = True,
    pods: StepPods = NO_STEP_PODS,
) -> Any:  # fmt: skip
    """The pipeline with at most ``parallelism`` recipes at a time (0: all at once) and ``retries`` per step
    (``pipelines.get_pipelines``)."""

    @dsl.pipeline(name=NAME, description="Compare FP8 precision recipes end to end: accuracy, mismatch, throughput.")
    def recipe_comparison(
        recipes: list = list(CORE_RECIPES),  # noqa: B006
        model_source: str = stages.DEFAULT_MODEL_SOURCE,
        seed: int = 0,
        seeds: list = [],  # noqa: B006
        sft_steps: int = stages.DEFAULT_SFT_STEPS,
        rl_steps: int = stages.DEFAULT_RL_STEPS,
        bench_steps: int = stages.DEFAULT_BENCH_STEPS,
        run_config: dict = {},  # noqa: B006
        convert_recipe: str = stages.DEFAULT_FP8_RECIPE,
        experiment: str = stages.DEFAULT_EXPERIMENT,
        work_dir: str = CLUSTER_WORK_DIR,
        backend: str = stages.DEFAULT_BACKEND,
        device: str = "auto",
        pvc_name: str = DEFAULT_PVC,
        rayjob_defaults: str = DEFAULT_RAYJOB_DEFAULTS,
        mlflow_secret: str = DEFAULT_MLFLOW_SECRET,
        hf_secret: str = DEFAULT_HF_SECRET,
        diagnose: bool = False,
        diagnose_target: float = 1.02,
    ) -> None:
        """The pipeline's parameters: the module docstring."""
        refs = ClusterRefs(pvc_name, rayjob_defaults, mlflow_secret, hf_secret, retries, medium, gpus, pods)
        with dsl.ExitHandler(stages.finish(experiment, work_dir, refs)):
            tracking = stages.start(NAME, experiment, work_dir, refs)
            warm = stages.warm_up(NAME, stages.prepare(model_source, seed, refs), sft_steps, tracking, refs)
            conversion = stages.convert(warm, convert_recipe, refs)
            runs = stages.runs(recipes, seeds, seed, refs)
            with dsl.ParallelFor(runs.output, parallelism=parallelism) as run:
                params = stages.RecipeParams(run.seed, run_config, rl_steps, bench_steps, backend, device)
                rl, _, bench = stages.train_evaluate_benchmark(NAME, warm, tracking, run.recipe, params, refs)
                rl.after(conversion)
            with dsl.If(diagnose == True):  # noqa: E712 -- a KFP condition, not a Python comparison
                stages.diagnose(warm, convert_recipe, run_config, diagnose_target, device, refs)
            stages.compare(NAME, tracking, dsl.Collected(bench.outputs["Output"]), conversion, refs)

    return recipe_comparison


recipe_comparison = build()
