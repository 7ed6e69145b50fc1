"""Kubeflow Pipelines (KFP v2) of fp8rl: ``fp8-rl``, ``recipe-comparison``, ``fp8-benchmark``.

- ``python -m pipelines.compile [--output-dir DIR]``: the IR YAML of every pipeline, ready to upload;
- ``python -m pipelines.submit PIPELINE [--host URL] [--param k=v ...]``: a run on Kubeflow Pipelines,
  or, with ``--local`` or no host configured, on this machine with ``kfp.local``.

The pipelines only wire components (``components/``) and add Kubernetes settings (``pipelines.cluster``).
"""

from __future__ import annotations

from typing import Any

PIPELINE_NAMES = ("fp8-rl", "recipe-comparison", "fp8-benchmark")


def get_pipelines(parallelism: int = 0) -> dict[str, Any]:
    """``{name: pipeline}`` (KFP ``GraphComponent``s) with at most ``parallelism`` recipes at a time (0: no
    limit, as compiled for a cluster; local runs use 1). Importing them imports kfp and the components."""
    from pipelines import fp8_benchmark, fp8_rl, recipe_comparison

    return {
        fp8_rl.NAME: fp8_rl.fp8_rl,
        recipe_comparison.NAME: recipe_comparison.build(parallelism),
        fp8_benchmark.NAME: fp8_benchmark.build(parallelism),
    }
