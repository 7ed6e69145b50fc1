"""Building blocks the pipelines share: each adds one or more component tasks with their cluster settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kfp import dsl
from kfp.dsl import PipelineTask

from components.benchmark import benchmark
from components.compare import compare_recipes, comparison_runs
from components.convert import convert_to_fp8
from components.diagnose import diagnose_mismatch
from components.evaluate import evaluate
from components.prepare_model import prepare_model
from components.rl_step import rl_step
from components.sft_warmup import sft_warmup
from components.tracking import finish_tracking, start_tracking
from pipelines.cluster import ClusterRefs, on_cluster

# Parameter defaults the pipelines share (KFP reads each pipeline's defaults from its signature).
DEFAULT_MODEL_SOURCE = "tiny"  # a tiny preset: no download
DEFAULT_FP8_RECIPE = "fp8-e2e"  # fp8-rl's recipe; the conversion's scaling in the multi-recipe pipelines
DEFAULT_SFT_STEPS = 600
DEFAULT_RL_STEPS = 60
DEFAULT_BENCH_STEPS = 3
DEFAULT_EXPERIMENT = "fp8rl"
DEFAULT_BACKEND = "rayjob"


@dataclass(frozen=True)
class RecipeParams:
    """The pipeline parameters (channels) every recipe's RL step, evaluation and benchmark share."""

    seed: Any
    run_config: Any
    rl_steps: Any
    bench_steps: Any
    backend: Any
    device: Any


def start(pipeline_name: str, experiment: Any, work_dir: Any, refs: ClusterRefs) -> PipelineTask:
    task = start_tracking(
        experiment=experiment,
        work_dir=work_dir,
        pipeline_name=pipeline_name,
        kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
        kfp_run_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
    ).set_display_name("start MLflow run")
    return on_cluster(task, refs, tracked=True)


def finish(experiment: Any, work_dir: Any, refs: ClusterRefs) -> PipelineTask:
    """The exit task (``dsl.ExitHandler``): ends the run's MLflow runs still RUNNING as the pipeline ended."""
    task = finish_tracking(
        experiment=experiment, work_dir=work_dir, kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER
    ).set_display_name("end MLflow runs")
    return on_cluster(task, refs, tracked=True)


def prepare(model_source: Any, seed: Any, refs: ClusterRefs) -> PipelineTask:
    task = prepare_model(source=model_source, seed=seed).set_display_name("prepare model")
    return on_cluster(task, refs, hf_token=True, size="medium")


def warm_up(
    pipeline_name: str, base: PipelineTask, sft_steps: Any, tracking: PipelineTask, refs: ClusterRefs
) -> PipelineTask:
    task = sft_warmup(
        base_model=base.outputs["model"], steps=sft_steps, mlflow_run=tracking.outputs["mlflow_run"],
        pipeline_name=pipeline_name, kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
    ).set_display_name("SFT warm-up")  # fmt: skip
    return on_cluster(task, refs, tracked=True, size="medium")


def convert(model: PipelineTask, recipe: Any, refs: ClusterRefs) -> PipelineTask:
    task = convert_to_fp8(model=model.outputs["model"], recipe=recipe).set_display_name("convert to FP8")
    return on_cluster(task, refs, size="medium")


def diagnose(
    model: PipelineTask, recipe: Any, run_config: Any, target: Any, device: Any, refs: ClusterRefs
) -> PipelineTask:
    """``fp8rl diagnose`` of ``recipe`` on the warmed-up model (which layers to keep BF16), before any RL step."""
    task = diagnose_mismatch(
        model=model.outputs["model"], recipe=recipe, run_config=run_config, target=target, device=device
    ).set_display_name("diagnose FP8 mismatch")
    return on_cluster(task, refs, gpu=True)


def train_evaluate_benchmark(
    pipeline_name: str,
    model: PipelineTask,
    tracking: PipelineTask,
    recipe: Any,
    params: RecipeParams,
    refs: ClusterRefs,
) -> tuple[PipelineTask, PipelineTask, PipelineTask]:
    """RL step -> evaluation -> benchmark of one recipe, all three in that recipe's MLflow run."""
    common = {"recipe": recipe, "seed": params.seed, "run_config": params.run_config}
    run = tracking.outputs["mlflow_run"]
    rl = rl_step(
        model=model.outputs["model"], mlflow_run=run, steps=params.rl_steps, pipeline_name=pipeline_name,
        kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, backend=params.backend, **common,
    ).set_display_name("RL step")  # fmt: skip
    on_cluster(rl, refs, tracked=True, rayjob=True, size="medium")
    ev = evaluate(
        model=rl.outputs["trained"], mlflow_run=run, run_id=rl.outputs["Output"], device=params.device, **common
    )
    on_cluster(ev.set_display_name("evaluate"), refs, tracked=True, gpu=True)
    bench = benchmark(
        model=rl.outputs["trained"], mlflow_run=run, run_id=rl.outputs["Output"], steps=params.bench_steps,
        pipeline_name=pipeline_name, kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, device=params.device, **common,
    ).set_display_name("benchmark")  # fmt: skip
    on_cluster(bench.after(ev), refs, tracked=True, gpu=True)  # after evaluation: timings without a neighbour
    return rl, ev, bench


def runs(recipes: Any, seeds: Any, seed: Any, refs: ClusterRefs) -> PipelineTask:
    """Every recipe x seed (``seeds`` empty: ``seed``): the list the comparison's loop iterates."""
    task = comparison_runs(recipes=recipes, seeds=seeds, seed=seed).set_display_name("comparison runs")
    return on_cluster(task, refs)


def compare(
    pipeline_name: str, tracking: PipelineTask, run_ids: Any, conversion: PipelineTask, refs: ClusterRefs
) -> PipelineTask:
    task = compare_recipes(
        mlflow_run=tracking.outputs["mlflow_run"],
        run_ids=run_ids,
        conversion_report=conversion.outputs["report"],
        pipeline_name=pipeline_name,
        kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
    ).set_display_name("compare recipes")
    return on_cluster(task, refs, tracked=True)
