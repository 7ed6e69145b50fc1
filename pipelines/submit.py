"""``python -m pipelines.submit PIPELINE [--param key=value ...]``: run a pipeline on Kubeflow Pipelines, or locally.

With a KFP endpoint (``--host`` or ``$KF_PIPELINES_ENDPOINT``, ``--kube-context``, or ``--in-cluster``) the
pipeline is compiled and submitted through ``kfp.Client`` (``pipelines.remote``): one run, or with
``--schedule`` a recurring run; with ``--upload`` the pipeline (or a new version of it) is uploaded first and
the run is of that version. ``--wait`` follows the run to its end. Authentication is kfp.Client's: ``--token``
(or ``$KF_PIPELINES_TOKEN``) as a bearer token, ``--cookies``, ``--ssl-ca-cert``, the kubeconfig context, or a
pod's ServiceAccount token. With ``--local``, or when no endpoint is configured, the pipeline runs on this machine
(``pipelines.local``) and the comparison table and the MLflow command are printed.

Exit status: 0 on success; 1 when the run fails (locally, or with ``--wait``: the failed tasks are named);
2 for bad input (unknown pipeline, bad ``--param``/``--param-file``, a bad schedule) or an unreachable endpoint;
124 when ``--wait`` gives up after ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from fp8rl.errors import UserError
from pipelines.compile import CPU_ONLY_HELP, VALUES_HELP
from pipelines.remote import Endpoint, Submission, make_client, submit, wait

HOST_ENV = "KF_PIPELINES_ENDPOINT"  # kfp.Client's own variable
TOKEN_ENV = "KF_PIPELINES_TOKEN"
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # kfp.local colours task names in its messages
DEFAULT_WAIT_TIMEOUT_S = 24 * 3600
EXIT_FAILED, EXIT_BAD_INPUT, EXIT_TIMED_OUT = 1, 2, 124


def read_param_file(path: str) -> list[str]:
    """A YAML or JSON mapping of pipeline parameters, as ``key=value`` items for ``parse_params`` (values that
    are lists or mappings travel as JSON); errors name the file."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise UserError(f"--param-file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise UserError(f"--param-file {path}: not YAML or JSON ({e})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise UserError(f"--param-file {path}: expected a mapping of parameter names to values")
    items = []
    for key, value in data.items():
        text = (
            json.dumps(value)
            if isinstance(value, list | dict)
            else str(value).lower()
            if isinstance(value, bool)
            else str(value)
        )
        items.append(f"{key}={text}")
    return items


def submit_to_kfp(args: argparse.Namespace, name: str, pipeline: Any, arguments: Mapping[str, Any]) -> int:
    """Compile ``pipeline`` and submit it as ``args`` say; with ``--wait`` follow the run to its end."""
    from pipelines.compile import disable_caching, parse_digests, pipeline_ir, write_ir

    digests = parse_digests(args.digest)
    endpoint = Endpoint(
        args.host, args.token, args.namespace, args.cookies, args.ssl_ca_cert, args.ui_host, args.kube_context,
        args.in_cluster,
    )  # fmt: skip
    client = make_client(endpoint)
    with tempfile.TemporaryDirectory(prefix="fp8rl-submit-") as tmp:
        docs = pipeline_ir(pipeline, args.registry, digests, args.cpu_only)
        package = write_ir(disable_caching(docs) if args.caching is False else docs, Path(tmp) / f"{name}.yaml")
        sub = Submission(
            name, package, arguments, args.experiment, args.run_name, args.service_account, args.pipeline_root,
            args.upload, args.pipeline_name, args.version_name, args.schedule, args.max_concurrency,
            not args.no_catchup,
        )  # fmt: skip
        done = submit(client, sub, args.namespace)
    print(f"submitted {name} ({done.kind} {done.id}): {done.url}", flush=True)
    if not args.wait or done.kind != "run":
        return 0
    try:
        end = wait(client, done.id, args.timeout, args.poll)
    except TimeoutError as e:
        print(f"pipelines.submit: {e}", file=sys.stderr)
        return EXIT_TIMED_OUT
    if end.state == "SUCCEEDED":
        print(f"{name}: run {done.id} SUCCEEDED")
        return 0
    failed = "; ".join(end.failed_tasks) or "no task reported an error"
    print(f"pipelines.submit: run {done.id} {end.state}: {failed}", file=sys.stderr)
    return EXIT_FAILED


def submit_locally(args: argparse.Namespace, name: str, pipeline: Any, arguments: Mapping[str, Any]) -> None:
    from pipelines.local import run_locally

    print(f"running {name} locally with kfp.local (log: {Path(args.work_dir) / 'kfp-local'})", flush=True)
    run = run_locally(name, pipeline, arguments, Path(args.work_dir), verbose=args.verbose)
    print(f"\n{name} finished in {run.seconds:.0f} s; full log {run.log}")
    print(f"report: {run.report} (and comparison.html, plots/ in the MLflow comparison run)\n")
    if run.table:
        print(run.table)
    if run.tracking_uri.startswith(("sqlite:", "file:")) or "://" not in run.tracking_uri:
        print(f"open the runs: mlflow ui --backend-store-uri {run.tracking_uri}")
    else:
        print(f"open the runs: {run.tracking_uri}")
    if run.champion:
        from fp8rl.tracking.models import load_instructions

        print(f"the best recipe's model: {run.champion}\n{load_instructions(run.champion, run.tracking_uri)}")


def build_parser() -> argparse.ArgumentParser:
    from pipelines import PIPELINE_NAMES

    p = argparse.ArgumentParser(prog="python -m pipelines.submit", description=__doc__.split("\n\n")[0])
    p.add_argument("pipeline", metavar="PIPELINE", help=f"one of {', '.join(PIPELINE_NAMES)}")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="a pipeline parameter; repeat")
    p.add_argument(
        "--param-file", default=None, metavar="FILE", help="pipeline parameters from a YAML or JSON mapping; "
        "--param wins where both name one"
    )  # fmt: skip
    p.add_argument("--local", action="store_true", help="run here with kfp.local, even if a host is configured")
    p.add_argument("--work-dir", default="work", help="local runs: work dir, MLflow store and outputs (default: work)")
    p.add_argument("--verbose", action="store_true", help="local runs: show kfp.local's full executor logs")
    _where_options(p.add_argument_group("Kubeflow Pipelines: where"))
    _what_options(p.add_argument_group("Kubeflow Pipelines: what"))
    return p


def _where_options(k: argparse._ArgumentGroup) -> None:
    k.add_argument("--host", default=os.environ.get(HOST_ENV), help=f"KFP API endpoint (default: ${HOST_ENV}); "
                   "without a scheme, https:// as kfp.Client assumes")  # fmt: skip
    k.add_argument("--kube-context", default=None, help="reach KFP through this kubeconfig context's API server "
                   "(its service proxy to the ml-pipeline service); no --host needed")  # fmt: skip
    k.add_argument("--in-cluster", action="store_true", help="from a pod: the in-cluster KFP service and the pod's "
                   "ServiceAccount token (at $KF_PIPELINES_SA_TOKEN_PATH or kfp's default path)")  # fmt: skip
    k.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"bearer token (default: ${TOKEN_ENV})")
    k.add_argument("--namespace", default=None, help="KFP namespace (multi-user deployments)")
    k.add_argument("--cookies", default=None, help="cookies for the KFP endpoint (e.g. an auth session)")
    k.add_argument("--ssl-ca-cert", default=None, help="CA bundle that signed the endpoint's TLS certificate")
    k.add_argument("--ui-host", default=None, help="KFP UI base URL for the printed run URL (default: --host)")


def _what_options(r: argparse._ArgumentGroup) -> None:
    r.add_argument("--experiment", default="fp8rl", help="KFP experiment (default: %(default)s)")
    r.add_argument("--run-name", default=None, help="KFP run name (default: '<pipeline> <date time>')")
    r.add_argument(
        "--service-account", default=None, help="run the steps as this ServiceAccount (e.g. rl-fp8rl-pipeline)"
    )
    r.add_argument("--pipeline-root", default=None, help="where KFP writes the run's artifacts (e.g. s3://bucket/p)")
    caching = r.add_mutually_exclusive_group()
    caching.add_argument("--enable-caching", dest="caching", action="store_const", const=None, default=None,
                         help="each step's own setting (the default): preparation and conversion cached, steps that "
                         "write to MLflow never")  # fmt: skip
    caching.add_argument("--disable-caching", dest="caching", action="store_const", const=False,
                         help="no step served from KFP's cache")  # fmt: skip
    r.add_argument("--upload", action="store_true", help="upload the pipeline (a new version when it exists) and run "
                   "that version")  # fmt: skip
    r.add_argument("--pipeline-name", default=None, help="--upload: the pipeline's name (default: PIPELINE)")
    r.add_argument(
        "--version-name",
        default=None,
        help="--upload: the new version's name (default: <name>-<time>); KFP names a new pipeline's "
        "first version after the pipeline",
    )
    r.add_argument("--schedule", default=None, metavar="CRON", help="a recurring run on this cron schedule instead "
                   "of one run ('0 3 * * *': 03:00 daily; 6 fields: seconds first)")  # fmt: skip
    r.add_argument("--max-concurrency", type=int, default=1, help="--schedule: runs at once (default: 1)")
    r.add_argument("--no-catchup", action="store_true", help="--schedule: skip the runs missed while paused")
    r.add_argument("--wait", action="store_true", help="wait for the run to end: exit 0 on SUCCEEDED, otherwise 1 "
                   "naming the failed tasks")  # fmt: skip
    r.add_argument("--timeout", type=float, default=DEFAULT_WAIT_TIMEOUT_S, help="--wait: seconds (default: 1 day)")
    r.add_argument("--poll", type=float, default=10.0, help=argparse.SUPPRESS)
    r.add_argument("--registry", default=None, help="image registry prefix (as pipelines.compile --registry)")
    r.add_argument("--step-requests", default=None, metavar="CPU,MEMORY",
                   help="requests of the steps that hold a model (as pipelines.compile --step-requests)")  # fmt: skip
    r.add_argument("--cpu-only", action="store_true", help=CPU_ONLY_HELP)
    r.add_argument("--values", action="append", default=[], metavar="FILE", help=VALUES_HELP)
    r.add_argument(
        "--digest",
        action="append",
        default=[],
        metavar="IMAGE=DIGEST",
        help="refer to an image by digest (as pipelines.compile --digest); repeatable",
    )


def main(argv: Sequence[str] | None = None) -> int:
    from pipelines import get_pipelines
    from pipelines.compile import medium_step_size, values_step_pods
    from pipelines.local import LOCAL_PARALLELISM, LOCAL_RETRIES
    from pipelines.params import check_values, parse_params

    args = build_parser().parse_args(argv)
    try:
        local = args.local or not (args.host or args.kube_context or args.in_cluster)
        medium = medium_step_size(args.step_requests)
        available = get_pipelines(
            *((LOCAL_PARALLELISM, LOCAL_RETRIES) if local else (0, None)),
            medium,
            not args.cpu_only,
            values_step_pods(args.values),
        )
        if args.pipeline not in available:
            raise UserError(f"unknown pipeline {args.pipeline!r}; available: {', '.join(available)}")
        pipeline = available[args.pipeline]
        items = (read_param_file(args.param_file) if args.param_file else []) + args.param
        arguments = parse_params(args.pipeline, pipeline, items)
        check_values(arguments)
        if local:
            if not args.local:
                print(
                    f"no KFP endpoint configured (--host or ${HOST_ENV}, --kube-context, --in-cluster): running locally"
                )
            submit_locally(args, args.pipeline, pipeline, arguments)
            return 0
        return submit_to_kfp(args, args.pipeline, pipeline, arguments)
    except UserError as e:
        print(f"pipelines.submit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RuntimeError as e:  # kfp.local: "Pipeline ... finished with status FAILURE. Inner task failed: ..."
        print(f"pipelines.submit: {ANSI_COLOUR.sub('', str(e))}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
