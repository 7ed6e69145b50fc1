"""The RL step of one recipe as a KubeRay RayJob running ``fp8rl train``, waited for, its checkpoint brought back.

:func:`run_rl_step_as_rayjob` takes paths, a ``RunConfig`` and MLflow tags (no kfp): it is the RL-step
pipeline component's ``rayjob`` backend, and any other caller's (the CLI's) way to run a recipe on KubeRay.

Paths are shared: the pipelines mount the data PVC at ``/data`` in the step's pod, and the
chart's RayJob template (``pvcName``) mounts the same PVC at ``/data`` in every Ray pod, so a
path under ``cfg.work_dir`` (``/data/fp8rl`` on a cluster) names the same file on both sides.

1. Stage under ``<work_dir>/kfp-runs/<kfp run id>/<recipe>-seed<seed>/``: the input checkpoint
   (``model/``, copied from ``model_dir``), the run's input files (``inputs/``: a JSONL/Parquet
   task's files and a Python reward's source, ``fp8rl.tasks.bundle``) and the resolved run config
   (``run-config.yaml``) naming those copies. The KFP run id is the ``kfp.run_id`` tag (empty outside KFP).
2. Build the RayJob from the chart's template (:func:`fp8rl.kube.rayjob.build_rayjob`: a cluster of its own; or
   ``build_rayjob_for_cluster`` when the template names the chart's standing RayCluster); its entrypoint is
   ``fp8rl train --config ... --model ... --output-dir .../trained --parent-run-id ... --work-dir ...``.
3. :func:`fp8rl.kube.submit.submit_rayjob` creates it, streams the driver's log, and raises
   ``RayJobFailed`` naming the cause (image pull, unschedulable, OOM, the driver's traceback).
4. The recipe's MLflow run is the child of the comparison run that ``fp8rl train`` made for
   this recipe and seed; ``tags`` (the KFP tags, in a pipeline) are added to it.
5. The trained checkpoint is copied from the volume into ``output_dir``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from fp8rl.atomic import atomic_directory, atomic_write_text
from fp8rl.config import RunConfig
from fp8rl.errors import UserError
from fp8rl.kube.rayjob import KFP_RUN_LABEL, MAX_NAME_LENGTH, build_rayjob, build_rayjob_for_cluster
from fp8rl.kube.rayjob_template import load_template

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
STAGE_DIR = "kfp-runs"
KFP_RUN_ID_TAG = "kfp.run_id"  # the MLflow tag naming the pipeline run the step belongs to


def current_namespace() -> str:
    """The step pod's namespace (its service account's), else ``$POD_NAMESPACE``, else ``default``."""
    if SERVICE_ACCOUNT_NAMESPACE.is_file():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return os.environ.get("POD_NAMESPACE", "default")


def owner_pod_reference() -> dict[str, Any] | None:
    """An ownerReference to the step's own pod (``$FP8RL_POD_NAME``/``$FP8RL_POD_UID``, which the pipelines set
    from the downward API), else None.  The RayJob is created in that pod's namespace, so Kubernetes' garbage
    collector deletes it, its Ray pods and their GPUs, once the pod is deleted: a cancelled KFP run whose step was
    killed before it could clean up leaves nothing running."""
    name, uid = os.environ.get("FP8RL_POD_NAME", ""), os.environ.get("FP8RL_POD_UID", "")
    if not name or not uid:
        return None
    return {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid, "blockOwnerDeletion": False}


def rayjob_name(recipe: str, seed: int, kfp_run_id: str) -> str:
    """``fp8rl-<recipe>-<hash>``: a DNS-1035 label of at most 47 characters, unique per KFP run, recipe and seed."""
    digest = hashlib.sha256(f"{kfp_run_id}/{recipe}/{seed}".encode()).hexdigest()[:8]
    slug = re.sub(r"[^a-z0-9-]+", "-", recipe.lower()).strip("-")[: MAX_NAME_LENGTH - len("fp8rl--") - len(digest)]
    return f"fp8rl-{slug.strip('-') or 'recipe'}-{digest}"


def checkpointed(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``checkpoint_every`` set to ``eval_every`` where it is 0: a RayJob step always checkpoints to the
    shared volume, so a retried step (its pod killed) resumes after the last checkpoint into the same MLflow run
    instead of training again from step 0 (``fp8rl.kube.attempts``, ``fp8rl.loop``)."""
    return cfg if cfg.checkpoint_every else cfg.model_copy(update={"checkpoint_every": cfg.eval_every})


def stage(cfg: RunConfig, model_dir: str | Path, kfp_run_id: str) -> Path:
    """Copy the checkpoint and the run's input files and write the run config under the shared work directory;
    returns the stage dir."""
    from fp8rl.experiment import resolved_config
    from fp8rl.tasks.bundle import bundle_inputs

    stage_dir = Path(cfg.work_dir) / STAGE_DIR / (kfp_run_id or "no-run-id") / f"{cfg.recipe.name}-seed{cfg.seed}"
    with atomic_directory(stage_dir / "model", overwrite=True) as tmp:
        shutil.copytree(model_dir, tmp, dirs_exist_ok=True)
    cfg = bundle_inputs(cfg, stage_dir / "inputs")
    atomic_write_text(stage_dir / "run-config.yaml", yaml.safe_dump(resolved_config(cfg), sort_keys=False))
    return stage_dir


def train_entrypoint(stage_dir: Path, parent_run_id: str, work_dir: str) -> list[str]:
    """``fp8rl train`` of the staged run; its checkpoints (``checkpoint_every``) go to the shared volume, so a
    driver that loses Ray workers resumes from them (``ray.max_restarts``), and so does a retried step."""
    return [
        "fp8rl", "train", "--config", str(stage_dir / "run-config.yaml"), "--model", str(stage_dir / "model"),
        "--output-dir", str(stage_dir / "trained"), "--checkpoint-dir", str(stage_dir / "checkpoints"),
        "--parent-run-id", parent_run_id, "--work-dir", work_dir,
    ]  # fmt: skip


def find_recipe_run(cfg: RunConfig, parent_run_id: str) -> str:
    """The run ``fp8rl train`` made for ``cfg`` under ``parent_run_id`` (the latest, if it was retried)."""
    from fp8rl.experiment import run_name
    from fp8rl.tracking import configure_mlflow, fetch_recipe_runs

    runs = fetch_recipe_runs(cfg.experiment, parent_run_id, configure_mlflow(cfg.work_dir), metrics=[])
    mine = [r for r in runs if r.recipe == cfg.recipe.name and r.run_name == run_name(cfg)]
    if not mine:
        raise UserError(
            f"the RayJob finished but MLflow has no run {run_name(cfg)!r} under {parent_run_id}: "
            "do the Ray pods log to the same tracking server (rayjob.yaml mlflowTrackingUri)?"
        )
    return max(mine, key=lambda r: r.start_time_ms).run_id


def run_rl_step_as_rayjob(
    cfg: RunConfig,
    model_dir: str | Path,
    output_dir: str | Path,
    parent_run_id: str,
    tags: Mapping[str, str],
    template_path: str | Path,
    timeout_s: float,
    *,
    api: Any = None,
    submit: Callable[..., Any] | None = None,
) -> str:
    """Run ``cfg`` as a RayJob (module docstring); returns the recipe's MLflow run id.

    ``api`` (a :class:`fp8rl.kube.submit.KubeApis`) defaults to the in-cluster service account; ``submit``
    to :func:`fp8rl.kube.submit.submit_rayjob` (both replaceable in tests).
    """
    from fp8rl.kube.submit import KubeApis, submit_rayjob  # the kubernetes client: only when submitting
    from fp8rl.tracking import MlflowSink

    template = load_template(template_path)
    if not template.pvc_name:
        raise UserError(f"{template_path}: pvcName is empty, so the Ray pods could not read the staged checkpoint")
    kfp_run_id = tags.get(KFP_RUN_ID_TAG, "")
    cfg = checkpointed(cfg)
    stage_dir = stage(cfg, model_dir, kfp_run_id)
    name = rayjob_name(cfg.recipe.name, cfg.seed, kfp_run_id)
    entrypoint = train_entrypoint(stage_dir, parent_run_id, cfg.work_dir)
    print(f"[rl-step] RayJob {name}: {shlex.join(entrypoint)}", flush=True)
    labels = {"app.kubernetes.io/part-of": "fp8rl"}
    if re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", kfp_run_id):
        labels[KFP_RUN_LABEL] = kfp_run_id  # kubectl get rayjobs -l fp8rl/kfp-run-id=<id>; a retry knows its own
    if template.ray_cluster_name:  # the chart's standing RayCluster (ray.enabled)
        doc = build_rayjob_for_cluster(template, name, entrypoint, template.ray_cluster_name, current_namespace(),
                                       labels, owner=owner_pod_reference())  # fmt: skip
    else:
        doc = build_rayjob(template, name, entrypoint, current_namespace(), labels, owner=owner_pod_reference())
    (submit or submit_rayjob)(doc, api or KubeApis.from_environment(), timeout_s)
    run_id = find_recipe_run(cfg, parent_run_id)
    MlflowSink.attach(run_id, cfg.work_dir).set_tags(tags)
    with atomic_directory(output_dir, overwrite=True) as tmp:
        shutil.copytree(stage_dir / "trained", tmp, dirs_exist_ok=True)
    return run_id
