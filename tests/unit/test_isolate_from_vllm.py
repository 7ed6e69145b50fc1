"""The ``isolate_from_vllm`` marker (tests/conftest.py): such a test runs in a fresh process once vLLM is imported
here, and its failure there fails it here.  A stand-in module named ``vllm`` plays vLLM's import (the real one
is a GPU extra); the subprocess is a real pytest run."""

from __future__ import annotations

import os
import sys
import types

import pytest

ISOLATED = os.environ.get("FP8RL_TEST_ISOLATED") == "1"


@pytest.fixture(scope="module", autouse=True)
def vllm_imported():
    had = "vllm" in sys.modules
    if not had:
        sys.modules["vllm"] = types.ModuleType("vllm")  # stand-in: only its presence in sys.modules is read
    yield
    if not had:
        del sys.modules["vllm"]


@pytest.mark.isolate_from_vllm
def test_runs_in_a_process_of_its_own() -> None:
    # in the subprocess the stand-in was imported by the fixture again, but the marker runs the body there
    assert ISOLATED, "ran in the process that had imported vLLM"


@pytest.mark.isolate_from_vllm
@pytest.mark.xfail(
    condition=not ISOLATED, raises=pytest.fail.Exception, strict=True,
    reason="the subprocess's failure must fail the test here (pytest.fail, not the body's own AssertionError)",
)  # fmt: skip
def test_a_failure_in_the_subprocess_fails_here() -> None:
    raise AssertionError("failed in the subprocess" if ISOLATED else "ran here instead")


@pytest.mark.isolate_from_vllm
def test_a_skip_in_the_subprocess_is_a_skip_here() -> None:
    if ISOLATED:
        pytest.skip("no transformer_engine there")
    raise AssertionError("ran here instead")


def test_the_skip_above_is_reported_as_a_skip_with_its_reason() -> None:
    """Run it the way a user would (its own pytest), and read pytest's own summary."""
    import subprocess

    if ISOLATED:
        return
    node = f"{__file__}::test_a_skip_in_the_subprocess_is_a_skip_here"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", node],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "1 skipped" in proc.stdout and "in a process of its own: no transformer_engine there" in proc.stdout


def test_unmarked_tests_stay_here() -> None:
    assert not ISOLATED
