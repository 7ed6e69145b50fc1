"""The tiny model's SFT warm-up: its loss target and the cache key of its options."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path

from fp8rl.train.sft import STOP_WINDOW, SFTOptions, sft_warmup


def test_a_loss_target_stops_the_warm_up_once_the_recent_mean_reaches_it(tmp_path: Path) -> None:
    """A target every step meets stops the warm-up as soon as the window is full; the checkpoint is still written
    and evaluated."""
    opts = SFTOptions(steps=50, batch_size=16, eval_examples=10, stop_loss=100.0)
    summary = sft_warmup(tmp_path / "sft", opts, log_every=1_000)
    assert summary["steps"] == STOP_WINDOW
    assert (tmp_path / "sft" / "config.json").is_file()
    assert 0.0 <= summary["heldout_accuracy"] <= 1.0


def test_without_a_target_the_warm_up_runs_every_step(tmp_path: Path) -> None:
    summary = sft_warmup(tmp_path / "sft", SFTOptions(steps=12, batch_size=16, eval_examples=10), log_every=1_000)
    assert summary["steps"] == 12


def test_the_cache_key_names_a_loss_target_only_when_there_is_one() -> None:
    """Warm-ups cached before the target existed keep their key; a target makes another checkpoint."""
    opts = SFTOptions()
    before = {k: v for k, v in asdict(opts).items() if k != "stop_loss"}  # the options as they were without it
    assert opts.cache_key() == hashlib.sha256(json.dumps(before, sort_keys=True, default=str).encode()).hexdigest()[:12]
    assert replace(opts, stop_loss=0.6).cache_key() != opts.cache_key()
    assert replace(opts, stop_loss=0.6).cache_key() != replace(opts, stop_loss=0.5).cache_key()
