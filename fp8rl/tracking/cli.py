"""``fp8rl models list | download``: the trained checkpoints registered in MLflow (``fp8rl.tracking.models``) from
the command line: which recipe's model is the champion of each task, and a copy of one to serve."""

from __future__ import annotations

import argparse

WORK_DIR_HELP = "the work dir whose MLflow store to read, unless $MLFLOW_TRACKING_URI names a server (default: work)"


def _cmd_list(args: argparse.Namespace) -> int:
    from fp8rl.tracking.mlflow_sink import configure_mlflow
    from fp8rl.tracking.models import registered_versions

    uri = configure_mlflow(args.work_dir)
    versions = registered_versions(uri)
    if not versions:
        print(f"no registered fp8rl models in {uri} (the recipe-comparison pipeline registers its champion)")
        return 0
    print("| model | version | aliases | recipe | accuracy | run | comparison run | load |")
    print("|---|---|---|---|---|---|---|---|")
    for v in versions:
        cells = [v.name, v.version, ", ".join(v.aliases) or "-", v.recipe or "-", v.accuracy or "-", v.run_id or "-"]
        cells += [v.comparison_run_id or "-", v.uri]
        print("| " + " | ".join(cells) + " |")
    return 0


def _cmd_download(args: argparse.Namespace) -> int:
    from fp8rl.tracking.mlflow_sink import configure_mlflow
    from fp8rl.tracking.models import download_model, model_uri

    uri = model_uri(args.model)
    tracking_uri = configure_mlflow(args.work_dir)
    path = download_model(tracking_uri, uri, args.dest)
    print(f"{uri} -> {path}")
    print(f"serve it: vllm serve {path}   (a Hugging Face checkpoint directory; docs/tracking.md)")
    return 0


def add_models_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = sub.add_parser(
        "models", help="the trained checkpoints registered in MLflow: list them, download one to serve"
    ).add_subparsers(dest="models_command", required=True)
    p = models.add_parser("list", help="every version of the registered fp8rl-* models: aliases, recipe, accuracy")
    p.add_argument("--work-dir", default="work", help=WORK_DIR_HELP)
    p.set_defaults(func=_cmd_list)
    p = models.add_parser(
        "download", help="a registered model's checkpoint into a new directory (then `vllm serve DIR`)"
    )
    p.add_argument("model", metavar="MODEL", help="NAME (its champion), NAME@ALIAS, NAME/VERSION or models:/...")
    p.add_argument("dest", metavar="DIR", help="a directory that does not exist yet")
    p.add_argument("--work-dir", default="work", help=WORK_DIR_HELP)
    p.set_defaults(func=_cmd_download)
