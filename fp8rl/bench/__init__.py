"""Throughput benchmarks of the RL step per recipe, and the recipe-comparison report built from MLflow.

- ``fp8rl.bench.throughput``: ``benchmark_recipe`` (imports torch and the RL loop);
- ``fp8rl.bench.rollout``: ``measure_rollout``, the rollout engine's generation alone (``fp8rl bench rollout``);
- ``fp8rl.bench.report``: ``build_comparison_report`` (reads MLflow; no torch).

The submodules are imported on their own, so the report does not pull in torch.
"""
