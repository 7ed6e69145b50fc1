"""What ``make e2e`` needs beyond the cluster and the images, done here where this machine can do it, and one message
naming what only the user can provide.

    python scripts/kfp_backend/prepare.py            # install and build what is missing (root)
    python scripts/kfp_backend/prepare.py --check    # say what is missing and what would be done; change nothing

What it does itself, each only when missing:

- the Debian packages of the real node, the KFP UI check and the backend (MariaDB, git, npm):
  ``scripts/container_tools.sh --node --ui --kfp``, the helper that installs podman and Chromium;
- the MLMD server's virtual environment: ``ml-metadata==1.17.1`` (the one version ``mlmd_server.py`` is written
  for; its wheels are CPython 3.11's) into ``$TOOLS/mlmd-venv``, marked complete only once installed;
- KFP's backend (``build.sh``) and UI (``build_ui.sh``) into the tools cache, from ``KFP_SRC``.

What only the user can provide (all of it in one message, before anything runs, exit 1): ``KFP_SRC`` (a checkout of
kubeflow/pipelines at tag 2.17.0) while a build is missing, root while a package is missing, and a CPython 3.11
(``MLMD_PYTHON``, else ``python3.11`` or ``python3`` on PATH) while the MLMD environment is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TOOLS = Path(os.environ.get("FP8RL_TOOLS_DIR") or Path.home() / ".cache" / "fp8rl" / "tools")
KFP_VERSION = "2.17.0"
MLMD_REQUIREMENT = "ml-metadata==1.17.1"
MLMD_PYTHON_VERSION = (3, 11)
# what e2e.py starts as host processes; images.sh packs the driver, launcher and argoexec
BACKEND_BINARIES = ("apiserver", "persistence_agent", "scheduledworkflow", "driver", "launcher-v2",
                    "workflow-controller", "argoexec", "weed")  # fmt: skip
UI_PARTS = ("node/bin/node", "server/dist/server.js", "client/index.html", "bin/grpcwebproxy")  # as ui.missing_build
PACKAGE_OPTIONS = ("--node", "--ui", "--kfp")


@dataclass(frozen=True)
class Machine:
    """What this machine has: the tools cache, ``KFP_SRC``, root, the missing Debian tools, a CPython 3.11."""

    tools: Path
    kfp_src: str | None
    is_root: bool
    missing_tools: tuple[str, ...]
    packages: tuple[str, ...]
    python311: str | None


@dataclass
class Plan:
    actions: list[str] = field(default_factory=list)  # what this script does, in order
    user: list[str] = field(default_factory=list)  # what only the user can provide


def mlmd_venv(tools: Path) -> Path:
    return tools / "mlmd-venv"


def mlmd_ready(tools: Path) -> bool:
    """The environment is complete: its marker is written only after ``ml-metadata`` installed."""
    marker = mlmd_venv(tools) / ".fp8rl-complete"
    return marker.is_file() and marker.read_text().strip() == MLMD_REQUIREMENT


def missing_builds(tools: Path) -> list[str]:
    """The backend and UI builds absent from the tools cache: ``backend``, ``ui``."""
    backend = tools / f"kfp-{KFP_VERSION}" / "bin"
    ui = tools / f"kfp-{KFP_VERSION}-ui"
    return [name for name, gone in (
        ("backend", any(not (backend / b).is_file() for b in BACKEND_BINARIES)),
        ("ui", any(not (ui / p).is_file() for p in UI_PARTS)),
    ) if gone]  # fmt: skip


def plan(m: Machine) -> Plan:
    """What to do, and what only the user can provide, on machine ``m``."""
    out = Plan()
    if m.missing_tools:
        out.actions.append("install the Debian packages: scripts/container_tools.sh " + " ".join(PACKAGE_OPTIONS))
        if not m.is_root:
            out.user.append(f"root (sudo make e2e): the tools {' '.join(m.missing_tools)} come from the Debian "
                            f"packages {' '.join(m.packages)}, and the real node runs as root")  # fmt: skip
    if not mlmd_ready(m.tools):
        out.actions.append(f"create {mlmd_venv(m.tools)} with {MLMD_REQUIREMENT}")
        if m.python311 is None:
            out.user.append("a CPython 3.11 for the MLMD server (ml-metadata 1.17.1's wheels are 3.11's): python3.11 "
                            "on PATH, or MLMD_PYTHON=<its path>")  # fmt: skip
    builds = missing_builds(m.tools)
    script = {"backend": "scripts/kfp_backend/build.sh", "ui": "scripts/kfp_backend/build_ui.sh"}
    out.actions += [f"build KFP's {b} from KFP_SRC: {script[b]}" for b in builds]
    if builds and not (m.kfp_src and Path(m.kfp_src).is_dir()):
        given = f" (KFP_SRC={m.kfp_src} is not a directory)" if m.kfp_src else ""
        out.user.append(f"KFP_SRC=<a checkout of kubeflow/pipelines at tag {KFP_VERSION}>{given}: the "
                        f"{' and '.join(builds)} build(s) ({', '.join(script[b] for b in builds)}) start from it; "
                        "the Go and npm packages come from their registries")  # fmt: skip
    return out


def python311() -> str | None:
    """A CPython 3.11 interpreter: ``MLMD_PYTHON``, else ``python3.11`` or ``python3`` on PATH if it is 3.11."""
    want = f"{MLMD_PYTHON_VERSION[0]}.{MLMD_PYTHON_VERSION[1]}"
    for candidate in (os.environ.get("MLMD_PYTHON"), "python3.11", "python3"):
        path = candidate and shutil.which(candidate)
        if not path:
            continue
        done = subprocess.run([path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, check=False)  # fmt: skip
        if done.returncode == 0 and done.stdout.strip() == want:
            return path
    return None


def this_machine(tools: Path) -> Machine:
    done = subprocess.run([ROOT / "scripts" / "container_tools.sh", *PACKAGE_OPTIONS, "--check"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    lines = done.stdout.splitlines()
    return Machine(
        tools=tools, kfp_src=os.environ.get("KFP_SRC") or None, is_root=os.geteuid() == 0,
        missing_tools=tuple(lines[0].split()) if lines else (), packages=tuple(lines[1].split()) if lines else (),
        python311=python311(),
    )  # fmt: skip


def create_mlmd_venv(tools: Path, python: str) -> None:
    """``ml-metadata`` into a fresh ``$TOOLS/mlmd-venv`` (a half-made one is removed first), then its marker.  With
    the project's uv (``make install`` puts it beside this interpreter), as the project's own venv is made."""
    venv = mlmd_venv(tools)
    shutil.rmtree(venv, ignore_errors=True)
    print(f"prepare: {MLMD_REQUIREMENT} into {venv}", flush=True)
    uv = Path(sys.executable).parent / "uv"
    env = {**os.environ, "UV_NATIVE_TLS": "1"}  # the system's CA store, as the Makefile's installs
    subprocess.run([uv, "venv", "-q", "--python", python, venv], check=True, env=env)
    subprocess.run(
        [uv, "pip", "install", "-q", "--python", venv / "bin" / "python", MLMD_REQUIREMENT], check=True, env=env
    )
    subprocess.run([venv / "bin" / "python", "-c", "import ml_metadata"], check=True)
    (venv / ".fp8rl-complete").write_text(MLMD_REQUIREMENT + "\n")


def carry_out(m: Machine) -> None:
    if m.missing_tools:
        subprocess.run([ROOT / "scripts" / "container_tools.sh", *PACKAGE_OPTIONS], check=True)
    if not mlmd_ready(m.tools):
        assert m.python311 is not None  # plan() asked the user for one otherwise
        create_mlmd_venv(m.tools, m.python311)
    env = {**os.environ, "FP8RL_TOOLS_DIR": str(m.tools)}
    for build in missing_builds(m.tools):
        script = HERE / ("build.sh" if build == "backend" else "build_ui.sh")
        print(f"prepare: KFP's {build}: {script.relative_to(ROOT)} (KFP_SRC={m.kfp_src})", flush=True)
        subprocess.run(["bash", script], check=True, env=env)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="say what is missing and what would be done; change nothing")
    args = p.parse_args(argv)
    machine = this_machine(TOOLS)
    todo = plan(machine)
    if todo.user:
        lines = [f"make e2e needs what only you can provide ({len(todo.user)}):", *(f"  - {u}" for u in todo.user)]
        if todo.actions:
            lines += ["the rest it does itself, once those are there:", *(f"  - {a}" for a in todo.actions)]
        print("\n".join(lines), file=sys.stderr)
        return 1
    if args.check or not todo.actions:
        print("\n".join([f"prepare: would {a}" for a in todo.actions] or ["prepare: nothing missing"]))
        return 0
    carry_out(machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
