"""``make e2e``'s preparation (scripts/kfp_backend/prepare.py): what it does itself and the one message of what only the
user can provide.  The KFP source checkout and its hour-long builds cannot exist here: the builds are files in a
temporary tools cache, as build.sh and build_ui.sh leave them; the Debian check is the real container_tools.sh's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "kfp_backend"))

import prepare  # noqa: E402
from prepare import KFP_VERSION, MLMD_REQUIREMENT, Machine, plan  # noqa: E402


def _machine(tools: Path, **kw: object) -> Machine:
    base: dict = {"tools": tools, "kfp_src": None, "is_root": True, "missing_tools": (), "packages": (),
                  "python311": "/usr/bin/python3.11"}  # fmt: skip
    return Machine(**{**base, **kw})


def _built(tools: Path, backend: bool = True, ui: bool = True) -> None:
    if backend:
        for name in prepare.BACKEND_BINARIES:
            (tools / f"kfp-{KFP_VERSION}" / "bin").mkdir(parents=True, exist_ok=True)
            (tools / f"kfp-{KFP_VERSION}" / "bin" / name).write_text("")
    if ui:
        for part in prepare.UI_PARTS:
            (tools / f"kfp-{KFP_VERSION}-ui" / part).parent.mkdir(parents=True, exist_ok=True)
            (tools / f"kfp-{KFP_VERSION}-ui" / part).write_text("")
    (tools / "mlmd-venv").mkdir(parents=True, exist_ok=True)
    (tools / "mlmd-venv" / ".fp8rl-complete").write_text(MLMD_REQUIREMENT + "\n")


def test_a_fresh_machine_needs_only_kfp_src_from_the_user(tmp_path: Path) -> None:
    todo = plan(_machine(tmp_path, missing_tools=("/usr/sbin/mariadbd",), packages=("mariadb-server",)))
    assert len(todo.user) == 1 and "KFP_SRC=" in todo.user[0] and "2.17.0" in todo.user[0]
    assert "build.sh" in todo.user[0] and "build_ui.sh" in todo.user[0]
    assert [a.split(":")[0] for a in todo.actions] == [
        "install the Debian packages", f"create {tmp_path / 'mlmd-venv'} with {MLMD_REQUIREMENT}",
        "build KFP's backend from KFP_SRC", "build KFP's ui from KFP_SRC",
    ]  # fmt: skip


def test_with_kfp_src_it_builds_what_is_missing_and_asks_nothing(tmp_path: Path) -> None:
    _built(tmp_path, ui=False)
    todo = plan(_machine(tmp_path, kfp_src=str(tmp_path)))
    assert todo.user == [] and todo.actions == ["build KFP's ui from KFP_SRC: scripts/kfp_backend/build_ui.sh"]
    assert plan(_machine(tmp_path, kfp_src=str(tmp_path / "nowhere"))).user[0].count("is not a directory") == 1


def test_everything_in_place_needs_nothing(tmp_path: Path) -> None:
    _built(tmp_path)
    assert plan(_machine(tmp_path, is_root=False, python311=None)) == prepare.Plan([], [])


def test_root_and_python_are_asked_for_only_where_needed(tmp_path: Path) -> None:
    _built(tmp_path)
    (tmp_path / "mlmd-venv" / ".fp8rl-complete").unlink()  # a half-made environment counts as missing
    todo = plan(_machine(tmp_path, is_root=False, missing_tools=("npm",), packages=("npm", "git"), python311=None))
    assert len(todo.user) == 2
    assert todo.user[0].startswith("root (sudo make e2e)") and "npm" in todo.user[0]
    assert "CPython 3.11" in todo.user[1] and "MLMD_PYTHON" in todo.user[1]


def test_the_check_says_it_all_in_one_message_and_changes_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("KFP_SRC", "MLMD_PYTHON")}
    done = subprocess.run(
        [sys.executable, REPO / "scripts" / "kfp_backend" / "prepare.py", "--check"],
        env={**env, "FP8RL_TOOLS_DIR": str(tmp_path)}, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("make e2e needs what only you can provide") and "KFP_SRC=<" in done.stderr
    assert f"create {tmp_path / 'mlmd-venv'} with {MLMD_REQUIREMENT}" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_container_tools_check_lists_missing_tools_without_installing() -> None:
    done = subprocess.run([REPO / "scripts" / "container_tools.sh", "--kfp", "--check"], capture_output=True, text=True)
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    assert lines == [] or ("mariadb-server" in lines[1].split() and set(lines[0].split()) <= {
        "podman", "buildah", "mmdebstrap", "runc", "umoci", "skopeo", "/usr/sbin/mariadbd", "mariadb-install-db",
        "git", "npm"})  # fmt: skip
    bad = subprocess.run([REPO / "scripts" / "container_tools.sh", "--gpu"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--kfp" in bad.stderr


@pytest.mark.parametrize("option", ["--check"])
def test_prepare_has_a_help(option: str) -> None:
    done = subprocess.run([sys.executable, REPO / "scripts" / "kfp_backend" / "prepare.py", "--help"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert option in done.stdout
