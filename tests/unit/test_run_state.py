"""Loop checkpoints (fp8rl.run_state): a checkpoint that cannot be written says where and why, and leaves nothing;
one that cannot be read gives way to the one before it; a killed write leaves nothing the next write keeps."""

from __future__ import annotations

import gc
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fp8rl import run_state
from fp8rl.errors import UserError
from fp8rl.run_state import CheckpointReadError, LoopState, load_latest, save_loop_state


def _state(step: int) -> LoopState:
    return LoopState(step=step, trainer={"w": torch.ones(2)}, python_rng=random.Random(0).getstate(),
                     torch_rng=torch.get_rng_state(), initial={}, final={})  # fmt: skip


def test_a_checkpoint_round_trips(tmp_path: Path) -> None:
    save_loop_state(tmp_path, _state(3))
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 3 and torch.equal(loaded.trainer["w"], torch.ones(2))


def test_a_failed_write_names_the_checkpoint_and_the_free_space_and_leaves_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_loop_state(tmp_path, _state(1))

    def full_disk(*_a: object, **_k: object) -> None:  # what torch.save raises when the disk fills mid-write
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 964974592 vs 964974544")

    monkeypatch.setattr(run_state.torch, "save", full_disk)
    with pytest.raises(UserError) as err:
        save_loop_state(tmp_path, _state(2))
    message = str(err.value)
    assert "step-000002" in message and re.search(r"[0-9.]+ [MG]iB free", message) and "unexpected pos" in message
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == ["step-000001"]
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 1


def test_keep_prunes_all_but_the_newest_checkpoints(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save_loop_state(tmp_path, _state(step), keep=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == ["step-000003"]
    for step in (4, 5):
        save_loop_state(tmp_path, _state(step))  # the default keeps two
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == ["step-000004", "step-000005"]
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 5
    with pytest.raises(ValueError, match="keep"):
        save_loop_state(tmp_path, _state(6), keep=0)


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(("step-", ".step-")))


def test_a_corrupt_newest_checkpoint_gives_way_to_the_one_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for step in (1, 2):
        save_loop_state(tmp_path, _state(step))
    newest = tmp_path / "step-000002" / "state.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # truncated, as a disk that filled or a node that died mid-write
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 1
    err = capsys.readouterr().err
    assert str(newest) in err and "step-000001" in err
    older = tmp_path / "step-000001" / "state.pt"
    older.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointReadError) as failed:
        load_latest(tmp_path)
    assert str(newest) in str(failed.value) and str(older) in str(failed.value)


KILLED_WRITE = textwrap.dedent("""
    import os, random, signal, sys
    import torch
    from fp8rl import run_state

    def killed_mid_write(obj, path):  # half the bytes on the disk, then the process is gone (OOM kill, node loss)
        with open(path, "wb") as f:
            f.write(b"PK" * 1000)
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    run_state.torch.save = killed_mid_write
    state = run_state.LoopState(step=2, trainer={}, python_rng=random.Random(0).getstate(),
                                torch_rng=torch.get_rng_state(), initial={}, final={})
    run_state.save_loop_state(sys.argv[1], state)
""")


def test_a_killed_write_leaves_the_previous_checkpoint_and_the_next_write_removes_its_remains(tmp_path: Path) -> None:
    save_loop_state(tmp_path, _state(1))
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(tmp_path)], capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    remains = [name for name in _steps(tmp_path) if name.startswith(".step-000002.tmp-")]
    assert remains, _steps(tmp_path)  # what the kill left behind
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 1
    save_loop_state(tmp_path, _state(2))
    assert _steps(tmp_path) == ["step-000001", "step-000002"]


def test_the_checkpoint_is_fsynced_before_it_is_renamed_into_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order of the calls (a spy on os.fsync and os.replace: whether the bytes reach the platter is the
    kernel's): the state file and its directory are flushed before the rename that publishes them, the rename
    before ``LATEST`` names it."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync " + os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(f"replace {Path(dst).name}")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_loop_state(tmp_path, _state(1))
    published = events.index("replace step-000001")
    before = events[:published]
    assert any(e.startswith("fsync ") and e.endswith("/state.pt") for e in before), events
    assert any(e.startswith("fsync ") and ".step-000001.tmp-" in e and not e.endswith(".pt") for e in before), events
    assert f"fsync {tmp_path}" in events[published : events.index("replace LATEST")], events


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB filesystem (tmpfs), mounted for the test: needs root and the right to mount."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a 4 MiB tmpfs needs root (not root here)")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        gc.collect()  # a file torch's writer left open when the disk filled closes with its object
        if subprocess.run(["umount", str(mount)]).returncode:  # still busy: detached now, freed once closed
            subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_a_full_disk_keeps_the_previous_checkpoint_and_names_the_path_and_the_free_space(small_disk: Path) -> None:
    root = small_disk / "checkpoints"
    first = _state(1)
    first.trainer = {"w": torch.ones(256 * 1024)}  # 1 MiB
    save_loop_state(root, first)
    second = _state(2)
    second.trainer = {"w": torch.ones(1024 * 1024)}  # 4 MiB: more than the disk has left
    with pytest.raises(UserError) as err:
        save_loop_state(root, second)
    message = str(err.value)
    free = re.search(r"([0-9.]+) MiB free on its disk \(([^)]+)\)", message)
    assert free and free.group(2) == str(root), message
    assert abs(float(free.group(1)) - shutil.disk_usage(root).free / 2**20) < 0.2, message
    assert str(root / "step-000002") in message
    assert _steps(root) == ["step-000001"]  # nothing half-written is left
    loaded = load_latest(root)
    assert loaded is not None and loaded.step == 1 and torch.equal(loaded.trainer["w"], first.trainer["w"])


def test_a_resume_from_an_older_checkpoint_logs_no_step_twice(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """The newest checkpoint is corrupt: the loop resumes from the one before and computes the step between them
    again, which the sink already holds and does not get a second time."""
    from fp8rl.config import RunConfig, load_recipe
    from fp8rl.loop import run_rl
    from fp8rl.tracking import MemorySink

    def config(steps: int) -> RunConfig:
        return RunConfig.model_validate(
            {"recipe": load_recipe("bf16"), "steps": steps, "eval_every": 100, "eval_examples": 4, "eval_samples": 0,
             "device": "cpu", "grpo": {"prompts_per_step": 4, "group_size": 2}, "sampling": {"max_tokens": 8},
             "checkpoint_every": 1}
        )  # fmt: skip

    sink, ckpt, model = MemorySink(), tmp_path / "ckpt", tiny_models["tiny"]
    run_rl(config(3), model, sink, log=lambda _s: None, device="cpu", checkpoint_dir=ckpt)
    (ckpt / "step-000003" / "state.pt").write_bytes(b"corrupt")
    lines: list[str] = []
    run_rl(config(4), model, sink, log=lines.append, device="cpu", checkpoint_dir=ckpt)
    assert any("resumed from the checkpoint of step 2" in line for line in lines), lines
    assert [step for step, _ in sink.history("time/step_s")] == [1, 2, 3, 4]
    assert [step for step, _ in sink.history("eval/accuracy")] == [0, 3, 4]  # each run evaluates its last step


def test_a_rerun_without_a_checkpoint_logs_no_step_twice(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """An earlier attempt logged steps 1-2 into the run and left no checkpoint (checkpoint_every 0): the rerun
    starts again from step 0 and logs only the steps the run lacks."""
    from fp8rl.config import RunConfig, load_recipe
    from fp8rl.loop import run_rl
    from fp8rl.tracking import MemorySink

    def config(steps: int) -> RunConfig:
        return RunConfig.model_validate(
            {"recipe": load_recipe("bf16"), "steps": steps, "eval_every": 100, "eval_examples": 4, "eval_samples": 0,
             "device": "cpu", "grpo": {"prompts_per_step": 4, "group_size": 2}, "sampling": {"max_tokens": 8}}
        )  # fmt: skip

    sink, model = MemorySink(), tiny_models["tiny"]
    run_rl(config(2), model, sink, log=lambda _s: None, device="cpu")
    run_rl(config(3), model, sink, log=lambda _s: None, device="cpu")
    assert [step for step, _ in sink.history("time/step_s")] == [1, 2, 3]
    assert [step for step, _ in sink.history("eval/accuracy")] == [0, 2, 3]
