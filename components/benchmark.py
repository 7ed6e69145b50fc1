"""Throughput benchmark of one recipe's RL step: rollout / train tokens/s and weight-sync time and bytes."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Metrics, Model, Output

from components.images import COMPONENT_IMAGE, RUNTIME_IMAGE


@dsl.component(base_image=COMPONENT_IMAGE, install_kfp_package=False)
def benchmark_model(preset: str, model_source: str) -> str:
    """The model to benchmark: ``model_source`` when non-empty, else the ``preset``'s shape as random weights
    (``shape:<name>``), else the tiny model (``fp8rl.bench.presets.pipeline_model``).  An unknown preset fails
    here, before any model is made."""
    from fp8rl.bench.presets import pipeline_model

    return pipeline_model(preset, model_source)


@dsl.component(base_image=COMPONENT_IMAGE, install_kfp_package=False)
def benchmark_recipes(preset: str, recipes: list) -> list:
    """The recipes to benchmark: ``recipes`` when non-empty, else the ``preset``'s, else the core recipes (one list
    output, which a ParallelFor iterates).  An unknown preset or recipe fails here, before any model is made."""
    from fp8rl.bench.presets import pipeline_recipes

    return pipeline_recipes(preset, recipes)


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def benchmark(
    model: Input[Model],
    mlflow_run: Input[Artifact],
    recipe: str,
    seed: int,
    run_config: dict,
    pipeline_name: str,
    kfp_run_id: str,
    metrics: Output[Metrics],
    run_id: str = "",
    steps: int = 3,
    warmup_steps: int = 1,
    device: str = "auto",
    profile_train: bool = False,
    preset: str = "",
) -> str:
    """Median throughput over ``steps`` timed RL steps after ``warmup_steps`` (``fp8rl.bench.throughput``), logged
    as ``bench/*`` to the recipe's MLflow run ``run_id`` (or to a new child run when empty), with the system metrics
    of the benchmark; returns that run id.
    ``profile_train``: one more step, its policy step under the profiler (``bench/train_device_ms/<category>``).
    ``preset``: a ``fp8rl bench step --preset`` layout whose run-config settings and batch apply, ``run_config``
    over them, and whose steps apply where ``steps`` is 0 or ``warmup_steps`` -1 (without a preset: 5 and 2)."""
    from components.runtime import kfp_tags, log_kfp_metrics, read_run_ref, recipe_run, runs_fail_with_the_step
    from components.runtime import run_config as make_config
    from fp8rl.bench.presets import get_preset, pipeline_steps
    from fp8rl.bench.throughput import benchmark_recipe
    from fp8rl.tracking.vocabulary import bench_throughput

    ref = read_run_ref(mlflow_run)
    fields = get_preset(preset, "preset").run_fields(run_config) if preset else run_config
    steps, warmup_steps = pipeline_steps(preset, steps, warmup_steps)
    cfg = make_config(recipe, steps + warmup_steps + int(profile_train), seed, fields, ref)
    tags = kfp_tags(pipeline_name, kfp_run_id, "benchmark")
    with (
        recipe_run(ref, run_id, recipe, seed, tags, cfg.tracking) as run,
        runs_fail_with_the_step(ref, "benchmark", recipe, seed),
    ):
        result = benchmark_recipe(
            cfg, model.path, device, steps=steps, warmup_steps=warmup_steps, profile_train=profile_train
        )
        # a run of its own: the comparison's throughput keys too (an RL run has its own: fp8rl.tracking.vocabulary)
        run.log_metrics({**result.metrics(), **({} if run_id else bench_throughput(result.metrics()))}, step=0)
    run_id = run.run_id
    log_kfp_metrics(metrics, result.metrics())
    metrics.metadata["device_name"] = result.device_name
    if result.train_profile_error:  # the timed numbers are logged above; the asked-for profile is not there
        raise RuntimeError(
            f"benchmark of {recipe}: profile_train: the profiled step failed: {result.train_profile_error}"
        )
    return run_id
