"""The KFP UI driven by a real browser: upload a pipeline, start a run with changed parameters, see it succeed, open
a step's logs (``-m kfp_ui``; ``make e2e`` runs it against the KFP 2.17.0 backend and UI it starts).

It needs a running UI and what to run there, from the environment ``scripts/kfp_backend/e2e.py`` sets:
``FP8RL_KFP_UI_URL`` (the UI), ``FP8RL_KFP_API_URL`` (its API server, to follow the run), ``FP8RL_KFP_UI_PACKAGE`` (a
compiled pipeline to upload), ``FP8RL_KFP_UI_PARAMS`` (JSON: the parameters to type into the run form) and
``FP8RL_KFP_UI_SERVICE_ACCOUNT``; and Playwright (``pip install playwright``) driving Debian's Chromium
(``/usr/bin/chromium``, or ``FP8RL_CHROMIUM``). Without them it skips, saying which (CI has no KFP backend).
Screenshots go to ``FP8RL_KFP_UI_OUT``, else the test's temporary directory: ``01-pipeline.png`` (the uploaded
pipeline's graph), ``02-run-form.png``, ``03-run-succeeded.png``, ``04-run-parameters.png``, ``05-step-logs.png``, and
the run's id to ``run-id``.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

UI = os.environ.get("FP8RL_KFP_UI_URL", "")
API = os.environ.get("FP8RL_KFP_API_URL", "")
PACKAGE = os.environ.get("FP8RL_KFP_UI_PACKAGE", "")
PARAMS: dict[str, Any] = json.loads(os.environ.get("FP8RL_KFP_UI_PARAMS") or "{}")
SERVICE_ACCOUNT = os.environ.get("FP8RL_KFP_UI_SERVICE_ACCOUNT", "")
CHROMIUM = os.environ.get("FP8RL_CHROMIUM", "/usr/bin/chromium")
RUN_TIMEOUT_S = float(os.environ.get("FP8RL_KFP_UI_RUN_TIMEOUT_S", "1800"))
SUB_DAG = "exit-handler-1"  # the graph's top level: the steps sit in the exit handler's sub-DAG
LOG_STEP = "prepare model"  # whose logs are opened: every recipe-comparison run has it, and it logs what it loaded

_missing = [name for name, value in (("FP8RL_KFP_UI_URL", UI), ("FP8RL_KFP_API_URL", API),
            ("FP8RL_KFP_UI_PACKAGE", PACKAGE)) if not value]  # fmt: skip
if not Path(CHROMIUM).is_file():
    _missing.append(f"Chromium at {CHROMIUM} (apt-get install chromium)")

pytestmark = [
    pytest.mark.kfp_ui,
    pytest.mark.skipif(bool(_missing), reason=f"no KFP UI to drive (missing: {', '.join(_missing)}): `make e2e`"),
]


def _api(path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{API}/apis/v2beta1/{path}", timeout=10) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def _form_value(value: Any) -> str:
    """How the run form takes a parameter: strings as typed, everything else as JSON (lists, structs, numbers)."""
    return value if isinstance(value, str) else json.dumps(value)


@pytest.fixture()
def shots(tmp_path: Path) -> Path:
    out = Path(os.environ.get("FP8RL_KFP_UI_OUT") or tmp_path / "screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


def test_upload_run_succeeds_and_shows_a_steps_logs(shots: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the KFP UI check drives it)")
    name = f"fp8rl-ui-{int(time.time())}"
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.set_default_timeout(60_000)
        try:
            run_id = _upload_and_start(page, name, shots)
            (shots / "run-id").write_text(run_id)  # e2e.py checks this run's MLflow runs
            _wait_for_success(page, run_id, shots)
            _open_step_logs(page, shots)
        except Exception:
            page.screenshot(path=str(shots / "failure.png"), full_page=True)
            raise
        finally:
            browser.close()


def _upload_and_start(page: Any, name: str, shots: Path) -> str:
    """Upload the package as a new pipeline, then create a run of it from the form; returns the run's id."""
    page.goto(f"{UI}/#/pipelines")
    page.get_by_role("button", name="Upload pipeline").first.click()
    page.locator("#newPipelineName").fill(name)
    page.locator("#localPackageBtn").check()
    page.locator("#dropZone input[type=file]").set_input_files(PACKAGE)
    page.locator("#createNewPipelineOrVersionBtn").click()
    page.wait_for_url("**/#/pipelines/details/**")
    _show_steps(page)
    page.screenshot(path=str(shots / "01-pipeline.png"))

    page.get_by_role("button", name="Create run").first.click()
    page.wait_for_url("**/#/runs/new**")
    page.get_by_label("Run name").fill(f"{name} run")
    if SERVICE_ACCOUNT:
        page.get_by_label("Service Account").fill(SERVICE_ACCOUNT)
    for key, value in PARAMS.items():
        field = page.locator(f"input[id='{key}'], textarea[id='{key}']").first
        field.fill(_form_value(value))
    page.screenshot(path=str(shots / "02-run-form.png"), full_page=True)
    page.locator("#startNewRunBtn").click()
    page.wait_for_url("**/#/runs/details/**")
    run_id = page.url.rsplit("/", 1)[-1].split("?")[0]
    run = _api(f"runs/{run_id}")
    typed = run.get("runtime_config", {}).get("parameters", {})
    wrong = {k: (typed.get(k), v) for k, v in PARAMS.items() if typed.get(k) != v}
    assert not wrong, f"the run's parameters differ from what was typed (got, typed): {wrong}"
    return run_id


def _wait_for_success(page: Any, run_id: str, shots: Path) -> None:
    """Follow the run on the API server until it ends; the UI must then show it Succeeded, with the typed parameters."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    state = ""
    while time.monotonic() < deadline:
        state = _api(f"runs/{run_id}").get("state", "")
        if state in ("SUCCEEDED", "FAILED", "CANCELED", "SKIPPED"):
            break
        time.sleep(10)
    page.reload()
    _show_steps(page)
    page.screenshot(path=str(shots / "03-run-succeeded.png"))
    assert state == "SUCCEEDED", f"run {run_id} ended {state or 'not within the timeout'} (03-run-succeeded.png)"
    page.get_by_text("Detail", exact=True).click()
    assert _detail(page, "Status") == "Succeeded"
    for key, value in PARAMS.items():  # the parameters typed into the form, as the run's details show them
        if isinstance(value, str | int | float):
            assert _detail(page, key) == str(value), key
    page.screenshot(path=str(shots / "04-run-parameters.png"), full_page=True)


def _detail(page: Any, name: str) -> str:
    """The value beside ``name`` in the run's Detail tab (its run details and run parameters tables)."""
    cell = page.locator(f"xpath=//*[normalize-space(text())='{name}']/following-sibling::*[1]").first
    cell.wait_for()
    text: str = cell.inner_text()
    return text.strip()


def _show_steps(page: Any) -> None:
    """Open the exit handler's sub-DAG in the graph (the steps), if not open yet, and fit all of it into the view."""
    step = page.get_by_text(LOG_STEP, exact=True).first
    page.get_by_text(SUB_DAG, exact=True).or_(page.get_by_text(LOG_STEP, exact=True)).first.wait_for()
    if not step.is_visible():
        page.locator(".react-flow__node").filter(has_text=SUB_DAG).first.locator("[data-testid=expand-button]").click()
    step.wait_for()
    page.locator(".react-flow__controls-fitview").click()


def _open_step_logs(page: Any, shots: Path) -> None:
    """Click a step in the run's graph, open its Logs tab, and see the component's own output there."""
    page.get_by_text("Graph", exact=True).click()
    _show_steps(page)
    page.get_by_text(LOG_STEP, exact=True).first.click()
    page.get_by_text("Logs", exact=True).click()
    # the pod's log, read from the cluster by the UI's server: the step's output metadata, as the component wrote it
    page.get_by_text('"source": ', exact=False).first.wait_for()
    page.wait_for_timeout(1000)  # the tab switch animates
    page.screenshot(path=str(shots / "05-step-logs.png"))
