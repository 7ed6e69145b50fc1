"""MLflow's system metrics on a run: what the machine did while the run worked, beside what the run measured.

MLflow's own sampler (``mlflow.system_metrics.system_metrics_monitor.SystemMetricsMonitor``, the one behind
``mlflow.start_run(log_system_metrics=True)``) runs in a thread of this process. Every ``interval_s`` it logs, under
``system/`` with a step counter of its own (0, 1, 2, ... one per interval, continued when a later step of a pipeline
reopens the run):

- CPU and memory everywhere (psutil): ``system/cpu_utilization_percentage``, ``system/system_memory_usage_megabytes``,
  ``system/system_memory_usage_percentage``; disk and network too;
- per NVIDIA GPU where the NVIDIA management library finds one (nvidia-ml-py):
  ``system/gpu_<i>_utilization_percentage``, ``system/gpu_<i>_memory_usage_megabytes``, ``..._power_usage_watts``.

It samples the machine of the process that logs the run: the one-process loop's (its GPU), the pipeline step's pod,
or, for an RL step on Ray, the Ray driver's node, not the actors' (a benchmark on Ray samples its actors' GPUs into
``bench/peak_gpu_used_gb`` instead). The sampler stops by itself once the run is no longer RUNNING, so the run must be
open while the work it measures runs. A step shorter than one interval logs no sample.
"""

from __future__ import annotations

import logging
from typing import Any

_log = logging.getLogger(__name__)

PREFIX = "system/"
CPU_UTILIZATION = "system/cpu_utilization_percentage"
MEMORY_USED_MB = "system/system_memory_usage_megabytes"


def start_system_metrics(run_id: str, tracking_uri: str, interval_s: float) -> Any:
    """Start MLflow's sampler on ``run_id`` (continuing its ``system/`` steps); returns it for
    ``stop_system_metrics``."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, resume_logging=True, tracking_uri=tracking_uri)
    monitor.start()
    _log.info(
        "system metrics of run %s every %g s: %s", run_id, interval_s, [type(m).__name__ for m in monitor.monitors]
    )
    return monitor


def stop_system_metrics(monitor: Any) -> None:
    """Stop the sampler and send what it holds (before the run ends: a sample logged after is refused)."""
    monitor.finish()
