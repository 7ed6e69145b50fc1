"""A KFP retry of the RL step on the real node, in a namespace that enforces Pod Security Standards ``restricted``:
the step's pod is killed with SIGKILL (its container, as a lost node or an OOM kill ends it: no SIGTERM, no
cleanup, the pod object stays), and its Ray job dies too; KFP's retry, a new pod of the same step, finds the dead
attempt's RayJob under the same name, replaces it, resumes from the last checkpoint on the data volume into the same
MLflow run, and MLflow holds every step exactly once."""

from __future__ import annotations

import base64
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from test_real_node import (
    RUN_CONFIG,
    Mlflow,
    _core,
    _custom,
    _rl_step_pod,
    _stage_model,
    _start_tracking,
    _wait,
    release,  # noqa: F401  (the chart's fixture, used by name)
)

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]
RAY_TOKEN_SECRET = "rl-fp8rl-ray-token"


def _one_rayjob(cluster: Any, namespace: str) -> dict[str, Any]:
    (job,) = _custom(cluster).list_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs")["items"]
    return dict(job)


def _sigkill_container(cluster: Any, namespace: str, pod: str) -> None:
    """SIGKILL the pod's container through containerd on the node, as the kernel's OOM killer or a lost node would
    end it: the pod object stays (Failed), so its RayJob (owned by it) is not garbage-collected."""
    (status,) = _core(cluster).read_namespaced_pod(pod, namespace).status.container_statuses
    container_id = status.container_id.removeprefix("containerd://")
    cluster.node.ctr("tasks", "kill", "--signal", "SIGKILL", container_id)


def _stop_ray_job(cluster: Any, namespace: str, job: dict[str, Any]) -> None:
    """Stop the RayJob's Ray job through its dashboard (with the chart's Ray token): the driver dies as it would
    with its node."""
    from ray.job_submission import JobSubmissionClient

    core = _core(cluster)
    # the head's Service is headless (no cluster IP): the dashboard at the head pod's own IP, which this host (the
    # node) reaches on its CNI bridge
    selector = f"ray.io/cluster={job['status']['rayClusterName']},ray.io/node-type=head"
    (head,) = core.list_namespaced_pod(namespace, label_selector=selector).items
    token = base64.b64decode(core.read_namespaced_secret(RAY_TOKEN_SECRET, namespace).data["auth_token"]).decode()
    client = JobSubmissionClient(f"http://{head.status.pod_ip}:8265", headers={"Authorization": f"Bearer {token}"})
    client.stop_job(job["status"]["jobId"])


def test_a_sigkilled_step_is_retried_and_resumes_logging_every_step_once(
    real_cluster: Any, real_namespace: str, release: Path, tiny_models: dict[str, Path],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    cluster, ns = real_cluster, real_namespace
    kfp_run = uuid.uuid4().hex
    parent, ref = _start_tracking(cluster, ns, release, kfp_run)
    model = _stage_model(release, tiny_models["tiny"])
    steps = 40  # checkpointed every eval_every (2) steps: the RayJob step's default where checkpoint_every is 0
    first = _rl_step_pod(cluster, kfp_run, model, ref, "bf16", steps, RUN_CONFIG)
    core = _core(cluster)
    core.create_namespaced_pod(ns, first)
    checkpoints = release / "fp8rl" / "kfp-runs" / kfp_run / "bf16-seed0" / "checkpoints"
    _wait(lambda: any(checkpoints.glob("step-*")), 900, "the first attempt's first checkpoint", poll_s=1)
    job = _wait(lambda: (j := _one_rayjob(cluster, ns)).get("status", {}).get("jobId") and j, 60, "the Ray job id")
    _sigkill_container(cluster, ns, "rl-step")
    _wait(lambda: core.read_namespaced_pod("rl-step", ns).status.phase == "Failed", 60, "the killed step Failed")
    _stop_ray_job(cluster, ns, job)
    _wait(lambda: _one_rayjob(cluster, ns)["status"].get("jobStatus") == "STOPPED", 120, "the first Ray job STOPPED")
    resumed_at = int(max(checkpoints.glob("step-*")).name.removeprefix("step-"))

    # KubeRay may have removed the stopped RayJob by now (its TTL); where not, the retry must replace it
    left = bool(_custom(cluster).list_namespaced_custom_object("ray.io", "v1", ns, "rayjobs")["items"])
    retry = _rl_step_pod(cluster, kfp_run, model, ref, "bf16", steps, RUN_CONFIG)
    retry["metadata"]["name"] = "rl-step-retry"  # KFP's retry: a new pod of the same task, same inputs
    t0 = time.monotonic()
    core.create_namespaced_pod(ns, retry)
    phase = _wait(lambda: (p := core.read_namespaced_pod("rl-step-retry", ns).status.phase) in ("Succeeded", "Failed")
                  and p, 1200, "the retried step finished", poll_s=2)  # fmt: skip
    log = core.read_namespaced_pod_log("rl-step-retry", ns)
    assert phase == "Succeeded", log[-4000:]
    if left:
        assert f"[rayjob {job['metadata']['name']}] created again" in log, log[-4000:]
    assert "resumed from the checkpoint of step" in log, log[-4000:]
    client = Mlflow(cluster, ns).client(monkeypatch)
    experiment = client.get_run(parent).info.experiment_id
    (child,) = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")  # one run, both attempts
    history = sorted(m.step for m in client.get_metric_history(child.info.run_id, "train/loss"))
    assert history == list(range(1, steps + 1)), history  # every step once
    assert child.info.status == "FINISHED", child.info
    print(f"\n[real node] step SIGKILLed after the checkpoint of step >= {resumed_at}; the retry resumed and finished "
          f"in {time.monotonic() - t0:.0f} s, all {steps} steps logged once")  # fmt: skip
