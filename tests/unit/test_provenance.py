"""fp8rl.provenance: what an MLflow run says it was made with."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fp8rl import __version__
from fp8rl.provenance import PACKAGES, git_sha, gpu_tags, provenance_tags


def test_tags_name_every_package_the_commit_and_the_gpus() -> None:
    tags = provenance_tags()
    assert tags["fp8rl.version"] == __version__
    assert set(PACKAGES) <= {k.removeprefix("version.") for k in tags if k.startswith("version.")}
    assert tags["version.torch"] != "absent" and tags["python"].count(".") == 2
    assert {"gpu.count", "gpu.model"} <= set(tags)


def test_the_ray_clusters_gpus_not_the_drivers() -> None:
    resources = {"CPU": 32.0, "GPU": 2.0, "accelerator_type:H200": 1.0, "memory": 1e12}
    assert gpu_tags(resources) == {"gpu.count": "2", "gpu.model": "H200"}
    assert gpu_tags({"CPU": 4.0}) == {"gpu.count": "0", "gpu.model": "none"}


def test_the_git_sha_from_the_environment_or_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FP8RL_GIT_SHA", "0123456789ab")
    assert git_sha() == "0123456789ab"
    monkeypatch.delenv("FP8RL_GIT_SHA")
    repo = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    assert git_sha() == (head.stdout.strip() if head.returncode == 0 else "")
