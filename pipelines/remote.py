"""Kubeflow Pipelines through ``kfp.Client``: reach the API, upload a pipeline or a new version of it, start one
run or a recurring one, and wait for a run, naming the task that failed.

How the API is reached follows kfp.Client: a ``host`` (a scheme-less one means ``https://``, as kfp.Client
assumes), a bearer ``token``, ``cookies``, a CA bundle for a private CA (``ssl_ca_cert``), a kubeconfig context
(kfp.Client then goes through the Kubernetes API server's service proxy to the ``ml-pipeline`` service), or, from a pod,
the in-cluster service with the pod's projected ServiceAccount token (``kfp.client.ServiceAccountTokenVolumeCredentials``).
"""

from __future__ import annotations

import os
import re
import ssl
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8rl.errors import UserError

REACH_TIMEOUT_S = 10.0
IN_CLUSTER_HOST = "http://ml-pipeline.kubeflow.svc.cluster.local:8888"  # the KFP API service of a standard install
SA_TOKEN_ENV = "KF_PIPELINES_SA_TOKEN_PATH"  # kfp.Client's own variable and default path
SA_TOKEN_PATH = "/var/run/secrets/kubeflow/pipelines/token"
# KFP v2beta1 RuntimeState values that end a run
FINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "SKIPPED", "CANCELED", "CANCELLED"})


@dataclass(frozen=True)
class Endpoint:
    """Where and how to reach the KFP API (``python -m pipelines.submit``'s Kubeflow Pipelines options)."""

    host: str | None = None
    token: str | None = None
    namespace: str | None = None
    cookies: str | None = None
    ssl_ca_cert: str | None = None
    ui_host: str | None = None
    kube_context: str | None = None
    in_cluster: bool = False

    @property
    def configured(self) -> bool:
        return bool(self.host or self.kube_context or self.in_cluster)


@dataclass(frozen=True)
class Submission:
    """What to submit: a compiled ``package`` of pipeline ``name`` with its ``arguments``, and how."""

    name: str
    package: Path
    arguments: Mapping[str, Any]
    experiment: str
    run_name: str | None = None
    service_account: str | None = None
    pipeline_root: str | None = None
    upload: bool = False
    pipeline_name: str | None = None  # the uploaded pipeline's name (default: ``name``)
    version_name: str | None = None  # the new version's name (default: ``<name>-<time>``)
    schedule: str | None = None  # a cron expression: a recurring run instead of one run
    max_concurrency: int = 1
    catchup: bool = True


@dataclass(frozen=True)
class Submitted:
    kind: str  # "run" or "recurring run"
    id: str
    url: str
    pipeline_id: str | None = None
    version_id: str | None = None


def normalized_host(host: str) -> str:
    """``host`` as kfp.Client uses it: ``https://`` where no scheme is given, no trailing slash."""
    return (host if host.startswith("http") else "https://" + host).rstrip("/")


def check_reachable(
    host: str, token: str | None, ssl_ca_cert: str | None = None, timeout_s: float = REACH_TIMEOUT_S
) -> None:
    """Fail fast with a clear message when nothing answers at ``host``, or its TLS certificate is not trusted.

    kfp.Client retries its health check five times, five seconds apart, and logs a traceback each time; one GET of
    the health endpoint first tells "nothing there" (connection refused, unknown name, timeout) and "certificate not
    trusted" from anything that answers. Any HTTP status counts as an answer (401/403 mean auth, which kfp.Client
    reports itself). The probe trusts what kfp.Client will: the system's CAs, or ``ssl_ca_cert`` alone.
    """
    url = normalized_host(host) + "/apis/v2beta1/healthz"
    context = None
    if url.startswith("https://"):
        try:
            context = ssl.create_default_context(cafile=ssl_ca_cert)
        except (OSError, ssl.SSLError) as e:
            raise UserError(f"--ssl-ca-cert {ssl_ca_cert}: not a readable CA bundle ({e})") from None
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context):
            return
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, ssl.SSLCertVerificationError):
            hint = (
                "give the CA that signed it with --ssl-ca-cert" if not ssl_ca_cert else f"not signed by {ssl_ca_cert}"
            )
            raise UserError(
                f"Kubeflow Pipelines at {url}: TLS certificate not trusted ({reason.verify_message}); {hint}"
            ) from None
        raise UserError(f"cannot reach Kubeflow Pipelines at {url}: {reason}") from None


def make_client(endpoint: Endpoint) -> Any:
    """A kfp.Client for ``endpoint``; with ``in_cluster`` the in-cluster service and the pod's ServiceAccount token
    (``$KF_PIPELINES_SA_TOKEN_PATH``, default ``/var/run/secrets/kubeflow/pipelines/token``) unless a host or token
    is given."""
    from kfp.client import ServiceAccountTokenVolumeCredentials

    host, credentials = endpoint.host, None
    if endpoint.in_cluster:
        host = host or IN_CLUSTER_HOST
        token_path = os.environ.get(SA_TOKEN_ENV, SA_TOKEN_PATH)
        if not endpoint.token:
            if not Path(token_path).is_file():
                raise UserError(
                    f"--in-cluster: no ServiceAccount token at {token_path} (project a token with audience "
                    f"pipelines.kubeflow.org there, set ${SA_TOKEN_ENV}, or give --token)"
                )
            credentials = ServiceAccountTokenVolumeCredentials(token_path)
    if endpoint.kube_context and not host:
        check_kube_context(endpoint.kube_context)
    if host:
        check_reachable(host, endpoint.token, endpoint.ssl_ca_cert)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This client only works with", category=FutureWarning)
        return _client_class()(
            host=normalized_host(host) if host else None,
            existing_token=endpoint.token,
            namespace=endpoint.namespace or "kubeflow",
            cookies=endpoint.cookies,
            ssl_ca_cert=endpoint.ssl_ca_cert,
            kube_context=endpoint.kube_context,
            credentials=credentials,
            ui_host=endpoint.ui_host or (normalized_host(host) if host else None),
        )


def _client_class() -> type:
    """kfp.Client, keeping the service-proxy URL of a kubeconfig context whose user has a token.

    With a kubeconfig context and no host, kfp.Client (2.17) sets its API URL to the context's server plus the
    service-proxy path of ``ml-pipeline``. The kubernetes client's loader (30.x) also sets a hook that, for a user
    with a token (a static one, or one from an exec plugin such as a cloud CLI), rewrites the URL to the bare server
    before every request (and installs itself again), so each call would miss the proxy. The hook keeps refreshing
    the token; the URL, and this wrapper as the hook, are put back after it."""
    import kfp

    class Client(kfp.Client):  # type: ignore[misc]
        def _load_config(self, *args: Any, **kwargs: Any) -> Any:
            config = super()._load_config(*args, **kwargs)
            hook, url = config.refresh_api_key_hook, config.host
            if hook is not None and "/proxy" in url:

                def refresh(cfg: Any) -> None:
                    hook(cfg)  # sets the token, the bare server URL, and itself as the hook again
                    cfg.host, cfg.refresh_api_key_hook = url, refresh

                config.refresh_api_key_hook = refresh
            return config

    return Client


def check_kube_context(name: str) -> None:
    """``name`` must be a context of the kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``): kfp.Client would print
    "Failed to load kube config." and go on to a default host."""
    from kubernetes import config

    try:
        contexts, _ = config.list_kube_config_contexts(os.environ.get("KUBECONFIG"))
    except (config.ConfigException, OSError) as e:
        raise UserError(f"--kube-context {name}: no kubeconfig to read ({e})") from None
    names = [c["name"] for c in contexts]
    if name not in names:
        raise UserError(f"--kube-context {name}: not a context of the kubeconfig; its contexts: {', '.join(names)}")


def cron_expression(text: str) -> str:
    """KFP's six-field cron (seconds first); a five-field (standard) one gets ``0`` seconds."""
    fields = text.split()
    if len(fields) == 5:
        fields = ["0", *fields]
    if len(fields) != 6:
        raise UserError(
            f"--schedule {text!r}: expected a cron expression of 5 fields (minute hour day month weekday) or 6 "
            "(seconds first, as KFP takes it), e.g. '0 3 * * *' for 03:00 every day"
        )
    return " ".join(fields)


def upload(client: Any, sub: Submission) -> tuple[str, str]:
    """Upload ``sub.package`` as pipeline ``sub.pipeline_name`` or, when it exists, as a new version of it;
    returns (pipeline id, version id)."""
    name = sub.pipeline_name or sub.name
    version = sub.version_name or f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    pipeline_id = client.get_pipeline_id(name)
    if pipeline_id is None:
        pipeline_id = client.upload_pipeline(str(sub.package), pipeline_name=name).pipeline_id
        versions = client.list_pipeline_versions(pipeline_id, page_size=1, sort_by="created_at desc")
        version_id = versions.pipeline_versions[0].pipeline_version_id
        # KFP's upload names a new pipeline's first version after the pipeline and takes no version name
        named = (
            f"; its first version is named {name!r} (--version-name names the later ones)" if sub.version_name else ""
        )
        print(f"uploaded pipeline {name!r} ({pipeline_id}){named}")
    else:
        made = client.upload_pipeline_version(str(sub.package), pipeline_version_name=version, pipeline_id=pipeline_id)
        version_id = made.pipeline_version_id
        print(f"uploaded version {version!r} ({version_id}) of pipeline {name!r} ({pipeline_id})")
    return pipeline_id, version_id


def submit(client: Any, sub: Submission, namespace: str | None = None) -> Submitted:
    """One run, or a recurring run with ``sub.schedule``, of the package or (``sub.upload``) of its uploaded
    version."""
    cron = cron_expression(sub.schedule) if sub.schedule is not None else None  # bad input before any upload
    pipeline_id = version_id = None
    if sub.upload:
        pipeline_id, version_id = upload(client, sub)
    run_name = sub.run_name or f"{sub.name} {time.strftime('%Y-%m-%d %H-%M-%S')}"
    common: dict[str, Any] = {
        "pipeline_root": sub.pipeline_root,
        "service_account": sub.service_account,
    }
    source: dict[str, Any] = (
        {"pipeline_id": pipeline_id, "version_id": version_id}
        if sub.upload
        else {"pipeline_package_path": str(sub.package)}
    )
    if sub.schedule is not None or sub.upload:
        experiment_id = client.create_experiment(sub.experiment, namespace=namespace).experiment_id
    if sub.schedule is not None:
        made = client.create_recurring_run(
            experiment_id, run_name, cron_expression=cron, params=dict(sub.arguments),
            max_concurrency=sub.max_concurrency, no_catchup=not sub.catchup, **source, **common,
        )  # fmt: skip
        rid = made.recurring_run_id
        return Submitted("recurring run", rid, ui_url(client, f"recurringrun/details/{rid}"), pipeline_id, version_id)
    if sub.upload:
        run = client.run_pipeline(experiment_id, run_name, params=dict(sub.arguments), **source, **common)
        run_id = run.run_id
    else:
        run_id = client.create_run_from_pipeline_package(
            str(sub.package), arguments=dict(sub.arguments), run_name=run_name, experiment_name=sub.experiment,
            namespace=namespace, **common,
        ).run_id  # fmt: skip
    return Submitted("run", run_id, ui_url(client, f"runs/details/{run_id}"), pipeline_id, version_id)


def ui_url(client: Any, page: str) -> str:
    return f"{client._get_url_prefix().rstrip('/')}/#/{page}"  # kfp.Client's own UI links


@dataclass(frozen=True)
class RunEnd:
    state: str
    failed_tasks: list[str]  # "display name: error message" of the tasks that failed


def wait(client: Any, run_id: str, timeout_s: float, poll_s: float = 5.0, log: Callable[[str], None] = print) -> RunEnd:
    """Poll run ``run_id`` until it ends, printing each change of state; ``TimeoutError`` after ``timeout_s``."""
    start, last = time.monotonic(), None
    while True:
        run = client.get_run(run_id)
        state = str(run.state or "PENDING")
        if state != last:
            log(f"run {run_id}: {state} ({time.monotonic() - start:.0f} s)")
            last = state
        if state in FINAL_STATES:
            return RunEnd(state, failed_tasks(run))
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"run {run_id} is still {state} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def failed_tasks(run: Any) -> list[str]:
    """The failed steps of ``run`` (tasks with no child tasks: not the DAGs around them), each with its error."""
    details = getattr(run, "run_details", None)
    tasks = list(getattr(details, "task_details", None) or [])
    failed = [t for t in tasks if str(t.state) == "FAILED"]
    leaves = [t for t in failed if not t.child_tasks] or failed
    by_id = {getattr(t, "task_id", None): t for t in tasks}
    # a real backend leaves parent_task_id empty and links a task to its children (child_tasks[].task_id)
    parents = {getattr(c, "task_id", None): t for t in tasks for c in (t.child_tasks or [])}
    steps = failed_steps(tasks)  # for attempts nothing links to their step (KFP 2.17.0): known by their drivers
    out = []
    for t in leaves:
        message = getattr(t.error, "message", None) if t.error else None
        name = step_name(t, by_id, parents)
        if ARGO_NODE.fullmatch(name) and steps:
            name = f"{', '.join(steps)} ({name})"
        out.append(f"{name}: {message}" if message else name)
    return out


# what a KFP backend reports for the Argo nodes inside a step: its pod (one per attempt) and its driver
ARGO_NODE = re.compile(r"executor(\(\d+\))?|.*-driver|retry-.*")


KFP_DAG = re.compile(r"root|exit-handler-\d+|condition-\d+|for-loop-\d+(-iteration-\d+)?")


def failed_steps(tasks: list[Any]) -> list[str]:
    """The failed tasks that are pipeline steps: each has a ``<name>-driver`` task and is not a DAG of KFP's own."""
    names = {str(t.display_name) for t in tasks}
    return sorted(
        n
        for t in tasks
        if str(t.state) == "FAILED"
        and not ARGO_NODE.fullmatch(n := str(t.display_name))
        and not KFP_DAG.fullmatch(n)
        and f"{n}-driver" in names
    )


def step_name(task: Any, by_id: Mapping[Any, Any], parents: Mapping[Any, Any] | None = None) -> str:
    """The pipeline step a failed task belongs to: a real backend names the failed pod ``executor(0)`` (the
    attempt), whose parents lead to the step's own name (``prepare-model``); the attempt is kept in brackets."""

    def parent_of(t: Any) -> Any:
        return (parents or {}).get(getattr(t, "task_id", None)) or by_id.get(getattr(t, "parent_task_id", None))

    name = str(task.display_name)
    if not ARGO_NODE.fullmatch(name):
        return name
    parent, seen = parent_of(task), set()
    while parent is not None and id(parent) not in seen and ARGO_NODE.fullmatch(str(parent.display_name)):
        seen.add(id(parent))
        parent = parent_of(parent)
    return f"{parent.display_name} ({name})" if parent is not None else name
