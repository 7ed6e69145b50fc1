"""``fp8-rl``: one recipe end to end: prepare -> SFT warm-up -> FP8 conversion -> RL step -> evaluate -> benchmark -> report."""

from typing import Any

from kfp import dsl

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

NAME = "fp8-rl"


def build(
    retries: int = DEFAULT_RETRIES,
    medium: StepSize = STEP_SIZES["medium"],
    gpus: bool = True,
    pods: StepPods = NO_STEP_PODS,
) -> Any:
    """The pipeline with ``retries`` per step (``pipelines.get_pipelines``)."""

    @dsl.pipeline(name=NAME, description="One FP8 precision recipe end to end, tracked in MLflow.")
    def fp8_rl(
        recipe: str = stages.DEFAULT_FP8_RECIPE,
        model_source: str = stages.DEFAULT_MODEL_SOURCE,
        seed: int = 0,
        sft_steps: int = stages.DEFAULT_SFT_STEPS,
        rl_steps: int = stages.DEFAULT_RL_STEPS,
        bench_steps: int = stages.DEFAULT_BENCH_STEPS,
        run_config: dict = {},  # noqa: B006
        experiment: str = stages.DEFAULT_EXPERIMENT,
        work_dir: str = CLUSTER_WORK_DIR,
        backend: str = stages.DEFAULT_BACKEND,
        device: str = "auto",
        pvc_name: str = DEFAULT_PVC,
        rayjob_defaults: str = DEFAULT_RAYJOB_DEFAULTS,
        mlflow_secret: str = DEFAULT_MLFLOW_SECRET,
        hf_secret: str = DEFAULT_HF_SECRET,
    ) -> None:
        """The FP8 checkpoint is converted with ``recipe``'s scaling; the report has one row."""
        refs = ClusterRefs(pvc_name, rayjob_defaults, mlflow_secret, hf_secret, retries, medium, gpus, pods)
        with dsl.ExitHandler(stages.finish(experiment, work_dir, refs)):
            tracking = stages.start(NAME, experiment, work_dir, refs)
            warm = stages.warm_up(NAME, stages.prepare(model_source, seed, refs), sft_steps, tracking, refs)
            conversion = stages.convert(warm, recipe, refs)
            params = stages.RecipeParams(seed, run_config, rl_steps, bench_steps, backend, device)
            rl, _, bench = stages.train_evaluate_benchmark(NAME, warm, tracking, recipe, params, refs)
            rl.after(conversion)
            stages.compare(NAME, tracking, [], conversion, refs).after(bench)

    return fp8_rl


fp8_rl = build()
