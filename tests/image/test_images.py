"""The built images, run the way the cluster runs them (marker ``image``).

The component image runs as its own non-root user with the chart's container security context (read-only root file
system, no capabilities, no privilege escalation, ``HOME=/tmp`` on a tmpfs) and no network: the fp8rl CLI, a
checkpoint conversion compared bit for bit with the same conversion in the project's virtualenv, and one KFP
component through the KFP launcher's own entry (the command and arguments of the compiled IR, an executor input
file, artifacts under the launcher's ``/minio`` mount). The runtime image's imports are checked without a GPU.

``make images`` builds the images (images/build.sh --local-base). Without them the tier skips; with
``FP8RL_REQUIRE_IMAGES=component`` (or ``component,runtime``; CI sets it) a missing image or engine fails instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from components.images import COMPONENT_IMAGE, RUNTIME_IMAGE

pytestmark = pytest.mark.image

REPO = Path(__file__).resolve().parents[2]
ENGINE = os.environ.get("FP8RL_CONTAINER_ENGINE", "podman")
REQUIRED = {t.strip() for t in os.environ.get("FP8RL_REQUIRE_IMAGES", "").split(",") if t.strip()}
# The chart's containerSecurityContext (charts/fp8rl/values.yaml) and the HOME its pods set.
SECURE = ["--read-only", "--cap-drop=ALL", "--security-opt=no-new-privileges", "--tmpfs=/tmp", "--env=HOME=/tmp"]


# .ci/run builds the images beside the tests and writes "ok" (or the failure) here when the build ends
READY_FILE = os.environ.get("FP8RL_IMAGES_READY_FILE", "")
BUILD_WAIT_S = 3600.0


def _wait_for_the_build() -> None:
    """With ``FP8RL_IMAGES_READY_FILE`` set, wait until the image build running beside the tests has ended."""
    if not READY_FILE:
        return
    import time

    ready, deadline = Path(READY_FILE), time.monotonic() + BUILD_WAIT_S
    while not ready.is_file():
        if time.monotonic() > deadline:
            pytest.fail(f"the image build did not end within {BUILD_WAIT_S:.0f} s ({READY_FILE} not written)")
        time.sleep(5)
    status = ready.read_text().strip()
    if status != "ok":
        pytest.fail(f"the image build failed: {status}")


def _image(name: str, target: str) -> str:
    _wait_for_the_build()

    def unavailable(why: str) -> None:
        if target in REQUIRED:
            pytest.fail(f"{why} (FP8RL_REQUIRE_IMAGES={','.join(sorted(REQUIRED))})")
        pytest.skip(why)

    if shutil.which(ENGINE) is None:
        unavailable(f"no container engine '{ENGINE}' (make images installs podman)")
    if subprocess.run([ENGINE, "image", "exists", name], capture_output=True).returncode != 0:
        unavailable(f"image {name} not built (make images)")
    return name


@pytest.fixture(scope="module")
def component_image() -> str:
    return _image(COMPONENT_IMAGE, "component")


@pytest.fixture(scope="module")
def runtime_image() -> str:
    return _image(RUNTIME_IMAGE, "runtime")


def run_in(
    image: str, *command: str, mounts: tuple[tuple[Path, str, str], ...] = (), timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``command`` in a fresh container of ``image``, as the image's user; mounts are (host, container, ro|rw)."""
    volumes = [f"--volume={host}:{inside}:{mode}" for host, inside, mode in mounts]
    return subprocess.run(
        [ENGINE, "run", "--rm", "--network=none", *SECURE, *volumes, image, *command],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def world_readable_copy(src: Path, dst: Path) -> Path:
    """A copy of ``src`` the image's uid 1000 can read through a bind mount (pytest's temporary dirs are 0700)."""
    shutil.copytree(src, dst)
    for path in [dst, *dst.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dst


def writable_dir(path: Path) -> Path:
    """A host directory the image's uid 1000 can write through a bind mount."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    return path


def test_runs_as_the_non_root_user_on_a_read_only_root(component_image: str) -> None:
    proc = run_in(
        component_image, "sh", "-c", "id -u; id -g; touch /opt/venv/x 2>&1 || true; touch /tmp/ok && echo tmp-ok"
    )
    assert proc.returncode == 0, proc.stderr
    uid, gid, denied, tmp_ok = proc.stdout.splitlines()
    assert (uid, gid) == ("1000", "1000"), "the chart runs pods as uid/gid 1000"
    assert "Read-only file system" in denied, denied
    assert tmp_ok == "tmp-ok"


def test_kuberays_probe_command_is_there(component_image: str) -> None:
    """KubeRay's readiness and liveness probes of Ray pods run ``wget``: without it a Ray pod is never Ready and is
    restarted by its liveness probe (the real node showed it)."""
    proc = run_in(component_image, "wget", "--version")
    assert proc.returncode == 0 and "GNU Wget" in proc.stdout, proc.stderr


def test_fp8rl_cli_help(component_image: str) -> None:
    proc = run_in(component_image, "fp8rl", "--help")
    assert proc.returncode == 0, proc.stderr
    for command in ("convert", "train", "diagnose", "import-gguf"):
        assert command in proc.stdout


def test_pip_check_and_the_pinned_versions(component_image: str) -> None:
    proc = run_in(component_image, "sh", "-c", "pip check && cat /opt/venv/fp8rl-freeze.txt")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("No broken requirements"), lines[0]
    installed = {name.lower(): version for name, _, version in (x.partition("==") for x in lines[1:] if "==" in x)}
    pins = dict(x.split("==", 1) for x in (REPO / "constraints.txt").read_text().splitlines() if "==" in x)
    checked = 0
    for name, version in pins.items():
        if name.lower() in installed:
            assert installed[name.lower()].split("+")[0] == version, f"{name}: image {installed[name.lower()]}"
            checked += 1
    assert {"torch", "kfp", "mlflow", "transformers"} <= installed.keys() and checked >= 20, checked


def test_convert_in_the_image_is_bit_identical_to_the_venv(
    component_image: str, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from fp8rl.cli import main as fp8rl_main

    out = writable_dir(tmp_path / "out")
    args = ["--granularity", "block", "--pow2-scales"]
    proc = run_in(
        component_image,
        "fp8rl",
        "convert",
        *args,
        "/models/small",
        "/out/fp8",
        mounts=(
            (world_readable_copy(tiny_models["small"], tmp_path / "small"), "/models/small", "ro"),
            (out, "/out", "rw"),
        ),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert fp8rl_main(["convert", *args, str(tiny_models["small"]), str(tmp_path / "venv-fp8")]) == 0
    image_files = sorted(p.name for p in (out / "fp8").glob("*.safetensors"))
    assert image_files == sorted(p.name for p in (tmp_path / "venv-fp8").glob("*.safetensors")) and image_files
    fp8_tensors = 0
    for name in image_files:
        inside, venv = load_file(out / "fp8" / name), load_file(tmp_path / "venv-fp8" / name)
        assert inside.keys() == venv.keys()
        for key, tensor in inside.items():
            assert tensor.dtype == venv[key].dtype and tensor.shape == venv[key].shape, key
            assert tensor.view(-1).view(dtype=_byte_dtype(tensor)).equal(venv[key].view(-1).view(_byte_dtype(tensor)))
            fp8_tensors += "float8" in str(tensor.dtype)
    assert fp8_tensors > 0
    config = json.loads((out / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"


def _byte_dtype(tensor):  # type: ignore[no-untyped-def]
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]


def test_convert_component_through_the_kfp_launcher_entry(
    component_image: str, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """exec-convert-to-fp8 of the compiled recipe-comparison IR, run with its own command and arguments."""
    from pipelines import get_pipelines
    from pipelines.compile import pipeline_ir

    (spec, *_) = pipeline_ir(get_pipelines()["recipe-comparison"])
    container = spec["deploymentSpec"]["executors"]["exec-convert-to-fp8"]["container"]
    assert container["image"] == component_image

    # The launcher downloads input artifacts to, and uploads outputs from, local paths under /minio.
    minio = writable_dir(tmp_path / "minio")
    root = "minio://mlpipeline/v2/artifacts/recipe-comparison/run-1"
    model_dir = minio / "mlpipeline/v2/artifacts/recipe-comparison/run-1/prepare-model/model"
    shutil.copytree(tiny_models["small"], model_dir)
    outputs = writable_dir(tmp_path / "kfp_outputs")
    for path in [minio, *minio.rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o666)

    def artifact(name: str, schema: str, uri: str, metadata: dict[str, object] | None = None) -> dict[str, object]:
        return {
            "artifacts": [
                {"name": name, "type": {"schemaTitle": schema, "schemaVersion": "0.0.1"}, "uri": uri,
                 "metadata": metadata or {}}
            ]
        }  # fmt: skip

    executor_input = {
        "inputs": {
            "artifacts": {
                "model": artifact("model", "system.Model", f"{root}/prepare-model/model", {"preset": "small"})
            },
            "parameterValues": {"recipe": "fp8-e2e"},
        },
        "outputs": {
            "artifacts": {
                "fp8_model": artifact("fp8_model", "system.Model", f"{root}/convert-to-fp8/fp8_model"),
                "report": artifact("report", "system.Markdown", f"{root}/convert-to-fp8/report"),
            },
            "outputFile": "/tmp/kfp_outputs/output_metadata.json",
        },
    }
    args = [json.dumps(executor_input) if a == "{{$}}" else a for a in container["args"]]
    proc = run_in(
        component_image,
        *container["command"],
        *args,
        mounts=((minio, "/minio", "rw"), (outputs, "/tmp/kfp_outputs", "rw")),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    fp8_model = minio / "mlpipeline/v2/artifacts/recipe-comparison/run-1/convert-to-fp8/fp8_model"
    config = json.loads((fp8_model / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    report = (minio / "mlpipeline/v2/artifacts/recipe-comparison/run-1/convert-to-fp8/report").read_text()
    assert report.startswith("# FP8 conversion report") and "relative error" in report, report[:500]
    executor_output = json.loads((outputs / "output_metadata.json").read_text())
    (written,) = executor_output["artifacts"]["fp8_model"]["artifacts"]
    assert written["metadata"] == {"preset": "small", "recipe": "fp8-e2e", "granularity": "block"}


def test_runtime_image_imports_without_a_gpu(runtime_image: str) -> None:
    code = (
        "import json, importlib.metadata as md, torch, vllm, transformer_engine, ray, fp8rl, components, pipelines\n"
        "import transformer_engine.pytorch, vllm.entrypoints.llm, fp8rl.train.te_trainer, fp8rl.rollout.vllm_engine\n"
        "print(json.dumps({n: md.version(n) for n in ('torch', 'vllm', 'transformer-engine', 'ray', 'fp8rl')}"
        " | {'cuda': torch.version.cuda, 'gpu': torch.cuda.is_available()}))"
    )
    assert run_in(runtime_image, "wget", "--version").returncode == 0, "KubeRay's Ray pod probes run wget"
    proc = run_in(runtime_image, "python", "-c", code)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    versions = json.loads(proc.stdout.strip().splitlines()[-1])
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = dict(r.split("==", 1) for r in pyproject["optional-dependencies"]["gpu"])
    pins = dict(x.split("==", 1) for x in (REPO / "constraints.txt").read_text().splitlines() if "==" in x)
    assert versions["vllm"] == extra["vllm"]
    assert versions["transformer-engine"] == extra["transformer-engine[pytorch]"]
    assert versions["torch"].split("+")[0] == pins["torch"] and versions["ray"] == pins["ray"]
    assert versions["fp8rl"] == pyproject["version"]
    assert versions["cuda"].startswith("13.") and versions["gpu"] is False
    proc = run_in(runtime_image, "pip", "check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
