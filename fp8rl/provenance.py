"""What a run was made with, for MLflow: the software's versions, fp8rl's git commit, the GPUs.

Tagged on every RL run (``fp8rl.experiment.tracked_run``) so that a number in MLflow says where it came from.
Reading them is cheap: package metadata, one ``git`` call at most, and CUDA only where torch already has it.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

# distributions whose versions decide an FP8 RL number (absent ones are tagged "absent")
PACKAGES = ("torch", "vllm", "transformer-engine", "ray", "transformers", "mlflow")


def git_sha() -> str:
    """fp8rl's git commit: ``$FP8RL_GIT_SHA`` (images set it), else the checkout's, else empty."""
    sha = os.environ.get("FP8RL_GIT_SHA", "")
    if sha:
        return sha
    import fp8rl

    try:
        proc = subprocess.run(
            ["git", "-C", str(Path(fp8rl.__file__).resolve().parent), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=5,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""  # no git here (an installed wheel, an image)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def gpus_here() -> tuple[int, str]:
    """(count, model) of the CUDA devices this process sees; (0, "") without CUDA."""
    try:
        import torch
    except ImportError:
        return 0, ""
    if not torch.cuda.is_available():
        return 0, ""
    return torch.cuda.device_count(), torch.cuda.get_device_name(0)


def gpu_tags(ray_resources: Mapping[str, float] | None = None) -> dict[str, str]:
    """``gpu.count`` and ``gpu.model``: this process's CUDA devices, or with ``ray_resources``
    (``ray.cluster_resources()``) the Ray cluster's (the model from its ``accelerator_type:<model>`` resource)."""
    if ray_resources is None:
        count, model = gpus_here()
    else:
        count = int(ray_resources.get("GPU", 0))
        model = ",".join(sorted(k.split(":", 1)[1] for k in ray_resources if k.startswith("accelerator_type:")))
    return {"gpu.count": str(count), "gpu.model": model or "none"}


def provenance_tags() -> dict[str, str]:
    """``fp8rl.version``, ``fp8rl.git_sha``, ``version.<package>``, ``python`` and this process's ``gpu.*``."""
    import fp8rl

    tags = {"fp8rl.version": fp8rl.__version__, "fp8rl.git_sha": git_sha() or "unknown"}
    tags |= {f"version.{name}": _version(name) for name in PACKAGES}
    return tags | {"python": platform.python_version()} | gpu_tags()
