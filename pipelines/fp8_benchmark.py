"""``fp8-benchmark``: settings -> prepare -> FP8 conversion -> per recipe (throughput benchmark) -> report.

Each recipe is benchmarked from the same checkpoint, as one child MLflow run of one comparison run. Parameters:
- ``preset``: a named layout of ``fp8rl bench step --preset`` (e.g. ``llama-1b-1gpu``): its recipes, model shape
  (random weights), steps, batch and run-config settings, ``run_config`` over them.
- ``recipes`` empty, ``model_source`` empty, ``bench_steps`` 0 and ``warmup_steps`` -1 mean the preset's (without
  one: bf16, fp8-rollout, fp8-e2e; the ``tiny`` model; 5 and 2).
"""

from typing import Any

from kfp import dsl

from components.benchmark import benchmark, benchmark_model, benchmark_recipes
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
    on_cluster,
)

NAME = "fp8-benchmark"


def build(
    parallelism: int = 0, retries: int = DEFAULT_RETRIES, medium: StepSize = STEP_SIZES["medium"], gpus: bool = True,
    pods: StepPods = NO_STEP_PODS,
) -> Any:  # fmt: skip
    """The pipeline with at most ``parallelism`` recipes at a time (0: all at once) and ``retries`` per step
    (``pipelines.get_pipelines``)."""

    @dsl.pipeline(name=NAME, description="RL-step throughput per FP8 precision recipe: rollout, train, weight sync.")
    def fp8_benchmark(
        preset: str = "",
        recipes: list = [],  # noqa: B006
        model_source: str = "",
        seed: int = 0,
        bench_steps: int = 0,
        warmup_steps: int = -1,
        run_config: dict = {},  # noqa: B006
        convert_recipe: str = stages.DEFAULT_FP8_RECIPE,
        experiment: str = "fp8rl-bench",
        work_dir: str = CLUSTER_WORK_DIR,
        device: str = "auto",
        profile_train: bool = False,
        pvc_name: str = DEFAULT_PVC,
        rayjob_defaults: str = DEFAULT_RAYJOB_DEFAULTS,
        mlflow_secret: str = DEFAULT_MLFLOW_SECRET,
        hf_secret: str = DEFAULT_HF_SECRET,
    ) -> None:
        """The pipeline's parameters: the module docstring."""
        refs = ClusterRefs(pvc_name, rayjob_defaults, mlflow_secret, hf_secret, retries, medium, gpus, pods)
        with dsl.ExitHandler(stages.finish(experiment, work_dir, refs)):
            tracking = stages.start(NAME, experiment, work_dir, refs)
            # single-output steps: kfp.local iterates only a pipeline input or a task's one `Output`, and hands a
            # loop no other task's parameter output (steps and warm-up are resolved by the benchmark step itself)
            to_run = benchmark_recipes(preset=preset, recipes=recipes).set_display_name("benchmark recipes")
            on_cluster(to_run, refs, size="small")
            source = benchmark_model(preset=preset, model_source=model_source).set_display_name("benchmark model")
            on_cluster(source, refs, size="small")
            model = stages.prepare(source.output, seed, refs)
            conversion = stages.convert(model, convert_recipe, refs)
            with dsl.ParallelFor(to_run.output, parallelism=parallelism) as recipe:
                bench = benchmark(
                    model=model.outputs["model"], mlflow_run=tracking.outputs["mlflow_run"], recipe=recipe,
                    seed=seed, run_config=run_config, pipeline_name=NAME, kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                    steps=bench_steps, warmup_steps=warmup_steps, device=device,
                    profile_train=profile_train, preset=preset,
                ).set_display_name("benchmark")  # fmt: skip
                on_cluster(bench.after(conversion), refs, tracked=True, gpu=True)
            stages.compare(NAME, tracking, dsl.Collected(bench.outputs["Output"]), conversion, refs)

    return fp8_benchmark


fp8_benchmark = build()
