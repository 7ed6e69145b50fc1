"""A KFP retry of the RL step: its RayJob name is the first attempt's, so the earlier RayJob is adopted (still going)
or replaced (dead) instead of a ``409``; and the retried ``fp8rl train`` resumes from the step's last checkpoint
into the same MLflow run, each step logged once.

The Kubernetes API is a fake holding RayJob objects (no API server exists here), fed the real RayJob documents the
step builds (``fp8rl.kube.rayjob``); the training is the real ``fp8rl train`` in subprocesses, the first one
SIGKILLed as a lost node or an OOM kill would end it."""

from __future__ import annotations

import copy
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from mlflow import MlflowClient

from fp8rl.config import RunConfig, load_recipe
from fp8rl.kube import rl_step as rayjob_backend
from fp8rl.kube.attempts import reclaim
from fp8rl.kube.errors import RayJobFailed
from fp8rl.kube.rayjob import build_rayjob
from fp8rl.kube.rayjob_template import parse_template
from fp8rl.kube.submit import KubeApis
from fp8rl.tracking import configure_mlflow, start_parent_run

KFP_RUN = "3f2b9c1e-0000-4000-8000-00000000abcd"
NS = "team-ns"
TEMPLATE = {
    "image": "fp8rl-runtime:0.1.0",
    "head": {"resources": {"requests": {"cpu": "1", "memory": "2Gi"}}},
    "workers": {"replicas": 1, "gpusPerWorker": 0, "resources": {"requests": {"cpu": "4", "memory": "16Gi"}}},
    "pvcName": "rl-fp8rl-data",
}


def _owner(pod: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": f"uid-{pod}", "blockOwnerDeletion": False}


def _attempt(pod: str, kfp_run: str = KFP_RUN, entrypoint: str = "fp8rl train --config /data/x.yaml") -> dict:
    """The RayJob an attempt of the step builds: its name from (KFP run, recipe, seed), owned by the attempt's pod."""
    name = rayjob_backend.rayjob_name("fp8-e2e", 0, kfp_run)
    labels = {"app.kubernetes.io/part-of": "fp8rl", "fp8rl/kfp-run-id": kfp_run}
    return build_rayjob(parse_template(TEMPLATE), name, entrypoint, NS, labels, owner=_owner(pod))


class RayJobStore:
    """The RayJob objects of one namespace behind the CustomObjectsApi calls ``reclaim`` makes."""

    def __init__(self, *existing: dict[str, Any]) -> None:
        self.objects = {d["metadata"]["name"]: copy.deepcopy(d) for d in existing}
        self.calls: list[str] = []

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, **kw) -> Any:  # type: ignore[no-untyped-def]
        self.calls.append("create")
        if body["metadata"]["name"] in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        self.objects[body["metadata"]["name"]] = copy.deepcopy(body)
        return body

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **kw) -> Any:  # type: ignore[no-untyped-def]
        self.calls.append("get")
        if name not in self.objects:
            raise ApiException(status=404, reason="NotFound")
        return copy.deepcopy(self.objects[name])

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body, **kw) -> Any:  # type: ignore[no-untyped-def]
        self.calls.append("patch")
        self.objects[name]["metadata"].update(body["metadata"])
        return self.objects[name]

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, **kw) -> Any:  # type: ignore[no-untyped-def]
        self.calls.append(f"delete {kw.get('propagation_policy')}")
        del self.objects[name]


def _reclaim(store: RayJobStore, doc: dict[str, Any], log: list[str]) -> bool:
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    return reclaim(KubeApis(custom=store, core=None), doc, 30.0, log.append, lambda: now[0], sleep)


def test_a_retry_asks_for_its_first_attempts_name() -> None:
    first, retry = _attempt("step-pod-1"), _attempt("step-pod-2")
    assert first["metadata"]["name"] == retry["metadata"]["name"]  # hence the 409 a dead first attempt causes
    assert first["metadata"]["ownerReferences"] != retry["metadata"]["ownerReferences"]


@pytest.mark.parametrize("status", [{"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"},
                                    {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}])  # fmt: skip
def test_a_running_or_finished_first_attempt_is_adopted(status: dict[str, str]) -> None:
    first, retry = _attempt("step-pod-1"), _attempt("step-pod-2")
    store = RayJobStore({**first, "status": status})
    log: list[str] = []
    assert _reclaim(store, retry, log) is True
    (kept,) = store.objects.values()
    assert kept["status"] == status  # the same RayJob: no second driver
    assert kept["metadata"]["ownerReferences"] == [_owner("step-pod-2")]  # goes with the retry's pod now
    assert store.calls == ["get", "patch"] and "adopted" in log[0]


@pytest.mark.parametrize("status", [{"jobDeploymentStatus": "Failed", "jobStatus": "FAILED"},
                                    {"jobDeploymentStatus": "Running", "jobStatus": "STOPPED"}])  # fmt: skip
def test_a_dead_first_attempt_is_replaced(status: dict[str, str]) -> None:
    first, retry = _attempt("step-pod-1"), _attempt("step-pod-2")
    store = RayJobStore({**first, "status": status})
    log: list[str] = []
    assert _reclaim(store, retry, log) is False
    (new,) = store.objects.values()
    assert "status" not in new and new["metadata"]["ownerReferences"] == [_owner("step-pod-2")]
    assert store.calls == ["get", "delete Foreground", "get", "create"]  # gone before it is created again


@pytest.mark.parametrize("other", [_attempt("p", kfp_run="another-run"), _attempt("p", entrypoint="python other.py")])
def test_a_rayjob_of_another_run_or_command_is_left_alone(other: dict[str, Any]) -> None:
    retry = _attempt("step-pod-2")
    other["metadata"]["name"] = retry["metadata"]["name"]
    store = RayJobStore({**other, "status": {"jobDeploymentStatus": "Failed"}})
    with pytest.raises(RayJobFailed, match="not an earlier attempt"):
        _reclaim(store, retry, [])
    assert store.calls == ["get"]


def _run_config(work: Path) -> RunConfig:
    return RunConfig.model_validate(
        {"recipe": load_recipe("fp8-e2e"), "steps": 4, "eval_every": 2, "eval_examples": 4, "eval_samples": 0,
         "device": "cpu", "grpo": {"prompts_per_step": 4, "group_size": 2}, "sampling": {"max_tokens": 8},
         "work_dir": str(work), "experiment": "retry"}
    )  # fmt: skip


def _train_argv(doc: dict[str, Any]) -> list[str]:
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:2] == ["fp8rl", "train"]
    return [sys.executable, "-m", "fp8rl", *argv[1:]]


def test_a_retried_step_resumes_from_its_checkpoint_into_the_same_run(
    tmp_path: Path, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    cfg = _run_config(work)
    assert cfg.checkpoint_every == 0  # the run config's default: the RayJob step checkpoints all the same
    parent = start_parent_run("retry", "compare", work)
    template = tmp_path / "rayjob.yaml"
    template.write_text(yaml.safe_dump(TEMPLATE))
    monkeypatch.setattr(rayjob_backend, "current_namespace", lambda: NS)
    tags = {rayjob_backend.KFP_RUN_ID_TAG: KFP_RUN}
    stage = work / "kfp-runs" / KFP_RUN / "fp8-e2e-seed0"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    names: list[str] = []

    def killed_after_step_2(doc: dict[str, Any], api: object, timeout_s: float) -> None:
        names.append(doc["metadata"]["name"])
        proc = subprocess.Popen(_train_argv(doc), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            if "step 2/4" in line:  # its checkpoint is written right after this line
                deadline = time.monotonic() + 120
                while not (stage / "checkpoints" / "step-000002").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                proc.send_signal(signal.SIGKILL)  # the pod is gone: no SIGTERM, no cleanup
                break
        proc.wait(timeout=120)
        raise RayJobFailed(doc["metadata"]["name"], f"driver killed ({proc.returncode})")

    def runs_to_the_end(doc: dict[str, Any], api: object, timeout_s: float) -> None:
        names.append(doc["metadata"]["name"])
        done = subprocess.run(_train_argv(doc), capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "resumed from the checkpoint of step 2" in done.stdout, done.stdout[-3000:]

    args = (cfg, tiny_models["tiny"], tmp_path / "trained", parent, tags, template, 600)
    with pytest.raises(RayJobFailed, match="driver killed"):
        rayjob_backend.run_rl_step_as_rayjob(*args, api=object(), submit=killed_after_step_2)
    assert yaml.safe_load((stage / "run-config.yaml").read_text())["checkpoint_every"] == 2  # eval_every
    run_id = rayjob_backend.run_rl_step_as_rayjob(*args, api=object(), submit=runs_to_the_end)
    assert names[0] == names[1]
    client = MlflowClient(configure_mlflow(work))
    experiment = client.get_experiment_by_name("retry")
    assert experiment is not None
    children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert [r.info.run_id for r in children] == [run_id]  # the retry logged into the first attempt's run
    assert sorted(m.step for m in client.get_metric_history(run_id, "reward")) == [1, 2, 3, 4]
    assert sorted(m.step for m in client.get_metric_history(run_id, "eval/accuracy")) == [0, 2, 4]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert (tmp_path / "trained" / "model.safetensors").is_file()


def test_a_first_attempt_collected_since_the_409_is_simply_created_again() -> None:
    retry = _attempt("step-pod-2")
    store = RayJobStore()  # the garbage collector deleted it between the create's 409 and the read
    assert _reclaim(store, retry, []) is False
    assert store.calls == ["get", "create"] and list(store.objects) == [retry["metadata"]["name"]]
