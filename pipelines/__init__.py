"""Kubeflow Pipelines (KFP v2) of fp8rl: ``fp8-rl``, ``recipe-comparison``, ``fp8-benchmark``.

- ``python -m pipelines.compile [--output-dir DIR]``: the IR YAML of every pipeline, ready to upload;
- ``python -m pipelines.submit PIPELINE [--host URL] [--param k=v ...]``: a run on Kubeflow Pipelines,
  or, with ``--local`` or no host configured, on this machine with ``kfp.local``.

The pipelines only wire components (``components/``) and add Kubernetes settings (``pipelines.cluster``).
"""

from __future__ import annotations

from typing import Any

PIPELINE_NAMES = ("fp8-rl", "recipe-comparison", "fp8-benchmark")


def get_pipelines(
    parallelism: int = 0, retries: int | None = None, medium: Any = None, gpus: bool = True, pods: Any = None
) -> dict[str, Any]:
    """``{name: pipeline}`` (KFP ``GraphComponent``s) with at most ``parallelism`` recipes at a time (0: no
    limit, as compiled for a cluster; local runs use 1) and ``retries`` per failed step (default
    ``pipelines.cluster.DEFAULT_RETRIES``; local runs use 0), and ``medium`` (a ``StepSize``, default
    ``STEP_SIZES["medium"]``) as the requests of the steps that hold a model; ``gpus=False`` for a cluster without
    GPUs (the GPU steps request none, at the medium size); ``pods`` (a ``StepPods``, from the chart's values) on every
    step's pod. Importing them imports kfp and the components."""
    from pipelines import fp8_benchmark, fp8_rl, recipe_comparison
    from pipelines.cluster import DEFAULT_RETRIES, NO_STEP_PODS, STEP_SIZES

    r = DEFAULT_RETRIES if retries is None else retries
    m = STEP_SIZES["medium"] if medium is None else medium
    p = NO_STEP_PODS if pods is None else pods
    return {
        fp8_rl.NAME: fp8_rl.build(r, m, gpus, p),
        recipe_comparison.NAME: recipe_comparison.build(parallelism, r, m, gpus, p),
        fp8_benchmark.NAME: fp8_benchmark.build(parallelism, r, m, gpus, p),
    }
