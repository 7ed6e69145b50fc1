"""``python -m pipelines.submit PIPELINE [--param key=value ...]``: run a pipeline on Kubeflow Pipelines, or locally.

With a KFP endpoint (``--host`` or ``$KF_PIPELINES_ENDPOINT``) the pipeline is compiled and
submitted with ``kfp.Client(...).create_run_from_pipeline_package``; the run's URL is printed.
Authentication is kfp.Client's: ``--token`` (or ``$KF_PIPELINES_TOKEN``) as a bearer token,
``--cookies``, ``--ssl-ca-cert``, the IAP/OAuth client ids of ``$KF_PIPELINES_*``, or the
kubeconfig context. With ``--local``, or when no endpoint is configured, the pipeline runs on
this machine (``pipelines.local``) and the comparison table and the MLflow command are printed.

Exit status: 0 on success, 2 for bad input (unknown pipeline, bad ``--param``) or an unreachable
endpoint, 1 when the pipeline itself fails locally.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import urllib.error
import urllib.request
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fp8rl.errors import UserError

HOST_ENV = "KF_PIPELINES_ENDPOINT"  # kfp.Client's own variable
TOKEN_ENV = "KF_PIPELINES_TOKEN"
REACH_TIMEOUT_S = 10.0
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # kfp.local colours task names in its messages


def check_reachable(host: str, token: str | None, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Fail fast with a clear message when nothing answers at ``host``.

    kfp.Client retries its health check five times, five seconds apart, and logs a traceback each
    time; one GET of the health endpoint first tells "nothing there" (connection refused, unknown
    name, timeout) from anything that answers. Any HTTP status counts as an answer (401/403 mean
    auth, which kfp.Client reports itself).
    """
    url = host.rstrip("/") + "/apis/v2beta1/healthz"
    if "://" not in host:
        url = "http://" + url
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise UserError(f"cannot reach Kubeflow Pipelines at {host}: {reason}") from None


def make_client(args: argparse.Namespace) -> Any:
    import kfp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This client only works with", category=FutureWarning)
        return kfp.Client(
            host=args.host,
            existing_token=args.token,
            namespace=args.namespace or "kubeflow",
            cookies=args.cookies,
            ssl_ca_cert=args.ssl_ca_cert,
            ui_host=args.ui_host,
        )


def run_url(client: Any, run_id: str, host: str) -> str:
    prefix = client._get_url_prefix() if hasattr(client, "_get_url_prefix") else host  # kfp.Client's own UI link
    return f"{prefix.rstrip('/')}/#/runs/details/{run_id}"


def submit_to_kfp(args: argparse.Namespace, name: str, pipeline: Any, arguments: Mapping[str, Any]) -> str:
    """Compile ``pipeline``, submit one run, return its URL."""
    from pipelines.compile import parse_digests, pipeline_ir, write_ir

    digests = parse_digests(args.digest)
    check_reachable(args.host, args.token)
    client = make_client(args)
    with tempfile.TemporaryDirectory(prefix="fp8rl-submit-") as tmp:
        package = write_ir(pipeline_ir(pipeline, args.registry, digests), Path(tmp) / f"{name}.yaml")
        result = client.create_run_from_pipeline_package(
            str(package),
            arguments=dict(arguments),
            run_name=args.run_name,
            experiment_name=args.experiment,
            namespace=args.namespace,
            service_account=args.service_account,
        )
    return run_url(client, result.run_id, args.host)


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


def build_parser() -> argparse.ArgumentParser:
    from pipelines import PIPELINE_NAMES

    p = argparse.ArgumentParser(prog="python -m pipelines.submit", description=__doc__.split("\n\n")[0])
    p.add_argument("pipeline", metavar="PIPELINE", help=f"one of {', '.join(PIPELINE_NAMES)}")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="a pipeline parameter; repeat")
    p.add_argument("--local", action="store_true", help="run here with kfp.local, even if a host is configured")
    p.add_argument("--work-dir", default="work", help="local runs: work dir, MLflow store and outputs (default: work)")
    p.add_argument("--verbose", action="store_true", help="local runs: show kfp.local's full executor logs")
    k = p.add_argument_group("Kubeflow Pipelines")
    k.add_argument("--host", default=os.environ.get(HOST_ENV), help=f"KFP API endpoint (default: ${HOST_ENV})")
    k.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"bearer token (default: ${TOKEN_ENV})")
    k.add_argument("--namespace", default=None, help="KFP namespace (multi-user deployments)")
    k.add_argument("--cookies", default=None, help="cookies for the KFP endpoint (e.g. an auth session)")
    k.add_argument("--ssl-ca-cert", default=None, help="CA bundle for a TLS endpoint")
    k.add_argument("--ui-host", default=None, help="KFP UI base URL for the printed run URL (default: --host)")
    k.add_argument("--experiment", default="fp8rl", help="KFP experiment (default: %(default)s)")
    k.add_argument("--run-name", default=None, help="KFP run name (default: generated)")
    k.add_argument(
        "--service-account", default=None, help="run the steps as this ServiceAccount (e.g. rl-fp8rl-pipeline)"
    )
    k.add_argument("--registry", default=None, help="image registry prefix (as pipelines.compile --registry)")
    k.add_argument(
        "--digest",
        action="append",
        default=[],
        metavar="IMAGE=DIGEST",
        help="refer to an image by digest (as pipelines.compile --digest); repeatable",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from pipelines import get_pipelines
    from pipelines.local import LOCAL_PARALLELISM
    from pipelines.params import check_values, parse_params

    args = build_parser().parse_args(argv)
    try:
        local = args.local or not args.host
        available = get_pipelines(parallelism=LOCAL_PARALLELISM if local else 0)
        if args.pipeline not in available:
            raise UserError(f"unknown pipeline {args.pipeline!r}; available: {', '.join(available)}")
        pipeline = available[args.pipeline]
        arguments = parse_params(args.pipeline, pipeline, args.param)
        check_values(arguments)
        if local:
            if not args.local:
                print(f"no KFP endpoint configured (--host or ${HOST_ENV}): running locally")
            submit_locally(args, args.pipeline, pipeline, arguments)
        else:
            print(f"submitted {args.pipeline}: {submit_to_kfp(args, args.pipeline, pipeline, arguments)}")
    except UserError as e:
        print(f"pipelines.submit: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # kfp.local: "Pipeline ... finished with status FAILURE. Inner task failed: ..."
        print(f"pipelines.submit: {ANSI_COLOUR.sub('', str(e))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
