"""Loop checkpoints (fp8rl.run_state): a checkpoint that cannot be written says where and why, and leaves nothing."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from fp8rl import run_state
from fp8rl.errors import UserError
from fp8rl.run_state import LoopState, load_latest, save_loop_state


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
    assert "step-000002" in message and "GiB free" in message and "unexpected pos" in message
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
