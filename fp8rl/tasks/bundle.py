"""Carry a run's input files with its config: the task's data files and a Python reward's source.

A run config names its inputs by path (``task.train``, ``task.test``, ``reward.function``).  Where
the run happens on other machines (a RayJob's pods reading a shared volume), those paths must
exist there too.  :func:`bundle_inputs` copies each file into one directory and returns the
config with its paths pointing at the copies, so the directory and the config travel together.
A Python reward is copied alone: modules it imports must be installed in the image or live on
the shared volume themselves (``docs/tasks.md``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from fp8rl.config import ConfigError, JsonlTaskConfig, PythonRewardConfig, RunConfig


def _copy(path_text: str, dest_dir: Path, slot: str, field: str) -> str:
    src = Path(path_text)
    if not src.is_file():
        raise ConfigError(f"{field}: {src} does not exist (resolved from {Path.cwd()})")
    dest_dir.mkdir(parents=True, exist_ok=True)
    dst = dest_dir / f"{slot}-{src.name}"
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)
    return str(dst)


def bundle_inputs(cfg: RunConfig, dest_dir: str | Path) -> RunConfig:
    """``cfg`` with ``task.train`` / ``task.test`` and ``reward.function``'s file copied under ``dest_dir``
    (``train-<name>``, ``test-<name>``, ``reward-<name>``) and its paths pointing there.  A config with no
    input files (the built-in arithmetic task, an exact-match reward) comes back unchanged."""
    dest = Path(dest_dir)
    task, reward = cfg.task, cfg.reward
    update: dict[str, Any] = {}
    if isinstance(task, JsonlTaskConfig):
        update["task"] = task.model_copy(
            update={
                "train": _copy(task.train, dest, "train", "task.train"),
                "test": _copy(task.test, dest, "test", "task.test"),
            }
        )
    if isinstance(reward, PythonRewardConfig):
        file, _, name = reward.function.rpartition(":")
        update["reward"] = reward.model_copy(
            update={"function": f"{_copy(file, dest, 'reward', 'reward.function')}:{name}"}
        )
    return cfg.model_copy(update=update) if update else cfg
