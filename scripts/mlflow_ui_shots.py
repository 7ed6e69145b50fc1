"""Screenshots of a recipe comparison in the real MLflow UI, taken in headless Chromium (``make mlflow-ui-shots``).

``python scripts/mlflow_ui_shots.py --work-dir work --out docs/images`` after ``make demo``: starts ``mlflow server``
on the work directory's store (or uses ``--url``, a server already running), finds the latest comparison run that
registered a champion, and saves

- ``mlflow-compare.png``: MLflow's "compare runs" view of its recipe runs, scrolled to the comparison's keys
  (``summary/*``: step time, tokens/s, held-out accuracy, token_mult_prob_error) side by side;
- ``mlflow-champion.png``: the registered model's page, its version under the alias ``champion``.

Needs Playwright (``pip install playwright``) driving Debian's Chromium (``/usr/bin/chromium``, or
``$FP8RL_CHROMIUM``); ``make mlflow-ui-shots`` installs both. Exit status 1 with the reason when the store holds no
comparison with a champion.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHROMIUM = os.environ.get("FP8RL_CHROMIUM", "/usr/bin/chromium")
STARTUP_TIMEOUT_S = 120
VIEWPORT = {"width": 1700, "height": 1000}
CHAMPION_TAG = "fp8rl.champion"  # fp8rl.tracking.models: models:/NAME@champion on the comparison run
PARENT_TAG = "mlflow.parentRunId"
# fp8rl.tracking.vocabulary.COMPARE_KEYS, the keys every recipe run carries (written out: a script of its own)
COMPARE_KEYS = ("summary/step_s", "summary/rollout_tokens_per_s", "summary/train_tokens_per_s",
                "summary/final_accuracy", "summary/mean_token_mult_prob_error")  # fmt: skip


@dataclass(frozen=True)
class Comparison:
    experiment_id: str
    parent_id: str
    run_ids: list[str]  # the recipe runs
    recipes: list[str]
    champion: str  # models:/NAME@champion


def latest_comparison(tracking_uri: str) -> Comparison:
    """The newest comparison run (of any experiment) that registered a champion, and its recipe runs."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    parents = client.search_runs(experiments, f"tags.`{CHAMPION_TAG}` != ''", order_by=["start_time DESC"])
    if not parents:
        raise SystemExit(f"{tracking_uri}: no comparison run with a champion (run `make demo` first)")
    parent = parents[0]
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.`{PARENT_TAG}` = '{parent.info.run_id}' and tags.recipe != ''"
    )
    children = sorted(children, key=lambda r: r.data.tags["recipe"])
    return Comparison(
        parent.info.experiment_id, parent.info.run_id, [r.info.run_id for r in children],
        [r.data.tags["recipe"] for r in children], parent.data.tags[CHAMPION_TAG],
    )  # fmt: skip


@contextlib.contextmanager
def mlflow_server(tracking_uri: str, log: Path) -> Iterator[str]:
    """``mlflow server`` on ``tracking_uri``'s store on a free loopback port; yields its URL, stops it after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env |= {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", tracking_uri,
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            _wait_healthy(url, proc, log)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=10)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"mlflow server exited with {proc.returncode}; its log: {log}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.25)
    raise SystemExit(f"mlflow server not healthy after {STARTUP_TIMEOUT_S} s; its log: {log}")


def take_shots(url: str, comparison: Comparison, out: Path) -> dict[str, str]:
    """Save the two PNGs under ``out``; returns ``{file name: the page's text}`` (what a test checks)."""
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    texts = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport=VIEWPORT)
        page.set_default_timeout(60_000)
        try:
            texts["mlflow-compare.png"] = _compare_view(page, url, comparison, out / "mlflow-compare.png")
            texts["mlflow-champion.png"] = _champion_page(page, url, comparison, out / "mlflow-champion.png")
        except Exception:
            page.screenshot(path=str(out / "mlflow-failure.png"), full_page=True)
            raise
        finally:
            browser.close()
    return texts


def _compare_view(page: Any, url: str, comparison: Comparison, path: Path) -> str:
    """The compare view's parallel-coordinates plot: one line per recipe run across the comparison's keys."""
    query = urllib.parse.urlencode(
        {"runs": json.dumps(comparison.run_ids), "experiments": json.dumps([comparison.experiment_id])}
    )
    page.goto(f"{url}/#/compare-runs?{query}")
    page.get_by_text("Parallel Coordinates Plot").first.wait_for()
    page.get_by_role("button", name="Clear All").wait_for()
    _close_assistant(page)
    page.get_by_role("button", name="Clear All").click()
    params, metrics = page.get_by_role("combobox").nth(0), page.get_by_role("combobox").nth(1)
    _choose(page, params, ["recipe_config.name"])  # the recipe's name (the parameter `recipe` is the same)
    _choose(page, metrics, list(COMPARE_KEYS))
    page.wait_for_timeout(1500)  # the plot redraws
    page.screenshot(path=str(path))
    return str(page.inner_text("body"))


def _choose(page: Any, select: Any, options: list[str]) -> None:
    """Type each option into a multi-select and take the match, then close its list."""
    for option in options:
        select.click()
        select.fill(option)
        page.get_by_title(option, exact=True).last.wait_for()
        page.keyboard.press("Enter")
    page.keyboard.press("Escape")


def _champion_page(page: Any, url: str, comparison: Comparison, path: Path) -> str:
    name = comparison.champion.removeprefix("models:/").split("@")[0]
    page.goto(f"{url}/#/models/{urllib.parse.quote(name)}")
    page.get_by_text("@ champion").first.wait_for()
    _close_assistant(page)
    page.screenshot(path=str(path), clip={"x": 0, "y": 0, "width": VIEWPORT["width"], "height": 560})
    return str(page.inner_text("body"))


def _close_assistant(page: Any) -> None:
    """MLflow 3.17 opens its assistant panel beside every page; close it so the page has the width."""
    close = page.locator("[aria-label='Close']").first
    with contextlib.suppress(Exception):
        close.click(timeout=3_000)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", default="work", help="the work dir of `make demo` (its mlflow.db)")
    p.add_argument("--url", default="", help="a running MLflow server instead of the work dir's store")
    p.add_argument("--out", default="docs/images", help="where the PNGs go")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.url:
        shots = take_shots(args.url, latest_comparison(args.url), out)
    else:
        store = f"sqlite:///{Path(args.work_dir).resolve() / 'mlflow.db'}"
        if not Path(args.work_dir, "mlflow.db").is_file():
            raise SystemExit(f"{args.work_dir}/mlflow.db: no MLflow store (run `make demo` first)")
        with mlflow_server(store, Path(args.work_dir) / "mlflow-ui-server.log") as url:
            shots = take_shots(url, latest_comparison(store), out)
    for name in shots:
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
