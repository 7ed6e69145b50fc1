"""``fp8-rl``: one recipe end to end: prepare -> SFT warm-up -> FP8 conversion -> RL step -> evaluate -> benchmark -> report."""

from kfp import dsl
from kfp.dsl import Markdown

from pipelines import stages
from pipelines.cluster import (
    CLUSTER_WORK_DIR,
    DEFAULT_HF_SECRET,
    DEFAULT_MLFLOW_SECRET,
    DEFAULT_PVC,
    DEFAULT_RAYJOB_DEFAULTS,
    ClusterRefs,
)

NAME = "fp8-rl"


@dsl.pipeline(name=NAME, description="One FP8 precision recipe end to end, tracked in MLflow.")
def fp8_rl(
    recipe: str = "fp8-e2e",
    model_source: str = "tiny",
    seed: int = 0,
    sft_steps: int = 600,
    rl_steps: int = 60,
    bench_steps: int = 3,
    run_config: dict = {},  # noqa: B006
    experiment: str = "fp8rl",
    work_dir: str = CLUSTER_WORK_DIR,
    backend: str = "rayjob",
    device: str = "auto",
    pvc_name: str = DEFAULT_PVC,
    rayjob_defaults: str = DEFAULT_RAYJOB_DEFAULTS,
    mlflow_secret: str = DEFAULT_MLFLOW_SECRET,
    hf_secret: str = DEFAULT_HF_SECRET,
) -> Markdown:
    """The FP8 checkpoint is converted with ``recipe``'s scaling; the report has one row."""
    refs = ClusterRefs(pvc_name, rayjob_defaults, mlflow_secret, hf_secret)
    tracking = stages.start(NAME, experiment, work_dir, refs)
    warm = stages.warm_up(stages.prepare(model_source, seed, refs), sft_steps, refs)
    conversion = stages.convert(warm, recipe, refs)
    p = {"seed": seed, "run_config": run_config, "rl_steps": rl_steps, "bench_steps": bench_steps}
    p |= {"backend": backend, "device": device}
    rl, _, bench = stages.train_evaluate_benchmark(NAME, warm, tracking, recipe, p, refs)
    rl.after(conversion)
    report = stages.compare(NAME, tracking, [], conversion, refs).after(bench)
    return report.outputs["report"]
