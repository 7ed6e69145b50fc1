"""The broadcast weight sync on real process groups: gloo on CPU, 2 and 3 processes, many buckets.

The same code runs over NCCL on GPUs (`ray.sync: collective`, docs/benchmarks.md); here every rank is a
spawned process and the receivers' bytes are compared with a payload requantized
independently, in the test process and in each receiver.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp8rl.models import make_tiny_model
from fp8rl.models.layers import fp8_module_names
from fp8rl.quant import QuantizedTensor, QuantSpec
from fp8rl.rollout import TorchRolloutEngine
from fp8rl.sync import SyncVerificationError, requantize_for_rollout, verify_engine_weights
from fp8rl.sync.base import Payload
from fp8rl.sync.broadcast import SyncTransportError, broadcast_payload, new_sync_group, receive_into
from fp8rl.sync.buckets import SyncLayout, empty_payload, layout_of, plan_buckets
from fp8rl.sync.collective import CollectiveSender

COLLECTIVE_TIMEOUT_S = 60  # a rank stuck in a collective gives up after this
SPAWN_TIMEOUT_S = 150  # the test kills its processes after this
SMALL_BUCKET = 16 * 1024  # the tiny model's ~0.2 MB payload then takes 20+ buckets, some oversize
SPEC = QuantSpec()


def _weights(seed: int = 0) -> tuple[dict[str, torch.Tensor], set[str]]:
    model, _ = make_tiny_model("tiny", seed=seed)
    return dict(model.state_dict()), {n + ".weight" for n in fp8_module_names(model)}


def _expected(seed: int = 0) -> Payload:
    weights, fp8 = _weights(seed)
    return requantize_for_rollout(weights, fp8, SPEC)


def _engine(precision: str = "fp8") -> TorchRolloutEngine:
    model, _ = make_tiny_model("tiny", seed=1)  # other weights than any push, so loading shows
    return TorchRolloutEngine(model, precision, SPEC)


def _as_bytes(payload: Payload) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for name, v in payload.items():
        if isinstance(v, QuantizedTensor):
            out[name] = (v.data.view(torch.uint8).clone(), v.scale_inv.view(torch.uint8).clone())
        else:
            out[name] = (v.reshape(-1).view(torch.uint8).clone(), None)
    return out


def _assert_bit_identical(got: dict[str, Any], want: Payload) -> None:
    expected = _as_bytes(want)
    assert list(got) == list(expected)
    for name, (data, scale) in expected.items():
        assert torch.equal(got[name][0], data), name
        assert (scale is None and got[name][1] is None) or torch.equal(got[name][1], scale), name


def _check_imports() -> None:
    # the GPU benchmark imports the transport on a machine with torch and transformers only
    heavy = [m for m in ("ray", "kubernetes", "pydantic", "mlflow", "kfp") if m in sys.modules]
    assert not heavy, f"importing the transport pulled in {heavy}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(fn: Any, nprocs: int, *args: Any) -> None:
    # a fork server imports torch and transformers once (~8 s on 2 busy cores) and forks every rank of
    # both tests from that clean process: no per-rank imports, and no fork of the threaded pytest process.
    # (It cannot preload this module: Python 3.11's fork server ignores the parent's sys.path.)
    multiprocessing.set_forkserver_preload(["fp8rl.models", "fp8rl.rollout", "fp8rl.sync.collective"])
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=1.0):  # re-raises a rank's exception, with its traceback
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{nprocs} ranks did not finish within {SPAWN_TIMEOUT_S}s")


def _error(fn: Any, *args: Any, expect: type[Exception] = SyncTransportError, **kw: Any) -> str:
    with pytest.raises(expect) as info:
        fn(*args, **kw)
    return str(info.value)


class _ClobberingEngine(TorchRolloutEngine):
    """Loads every bucket right, but loading lm_head (the last one) also changes the embedding (the first)."""

    def load_weights(self, weights: Any, version: int) -> None:
        super().load_weights(weights, version)
        if "lm_head.weight" in weights:
            self.model.get_input_embeddings().weight.data[0, 0] += 1


def _two_ranks(rank: int, port: int, layout: SyncLayout, out_dir: Path) -> None:
    """Default process group; rank 0 sends, rank 1 receives."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    res: dict[str, Any] = {}
    weights, fp8 = _weights()
    odd_model, _ = make_tiny_model("tiny-odd")
    odd_layout = layout_of(dict(odd_model.state_dict()))
    if rank == 0:
        _check_imports()
        payload = requantize_for_rollout(weights, fp8, SPEC)
        assert broadcast_payload(payload, layout, 0, None, "cpu", SMALL_BUCKET, verify=True) is payload
        res["sender_error"] = _error(broadcast_payload, payload, layout, 0, None, "cpu", SMALL_BUCKET)
        sync = CollectiveSender(fp8, SPEC, device="cpu", bucket_bytes=SMALL_BUCKET, verify=True)
        res["push_error"] = _error(sync.broadcast, weights, 4)
        res["stats"] = dataclasses.asdict(sync.broadcast(weights, 3))
        res["clobber_error"] = _error(sync.broadcast, weights, 5, expect=SyncVerificationError)
        broadcast_payload(payload, layout, 0, None, "cpu", SMALL_BUCKET)
    else:
        res["received"] = _as_bytes(broadcast_payload(None, layout, 0, None, "cpu"))
        res["receiver_error"] = _error(broadcast_payload, None, odd_layout, 0, None, "cpu")
        engine = _engine()
        res["version_error"] = _error(receive_into, engine, layout, 99, device="cpu")
        res["stats"] = dataclasses.asdict(receive_into(engine, layout, 3, device="cpu"))
        verify_engine_weights(engine, _expected(), 3)  # against its own requantization of the weights
        # every bucket passes its own check; only the checksums over the whole engine see the damage
        clobbering = _ClobberingEngine(make_tiny_model("tiny", seed=1)[0], "fp8", SPEC)
        res["clobber_error"] = _error(receive_into, clobbering, layout, 5, device="cpu", expect=SyncVerificationError)
        into = empty_payload(layout, "cpu")
        got = broadcast_payload(None, layout, 0, None, "cpu", into=into)
        assert all(got[name] is into[name] for name in into)
        res["into"] = _as_bytes(got)
    dist.destroy_process_group()
    torch.save(res, out_dir / f"rank{rank}.pt")


def test_two_processes_send_bit_identical_fp8_bytes_in_many_buckets(tmp_path: Path) -> None:
    expected = _expected()
    layout = layout_of(expected)
    buckets = plan_buckets(layout, SMALL_BUCKET)
    assert len(buckets) > 10 and any(b.nbytes > SMALL_BUCKET for b in buckets)
    assert sum(e.kind == "fp8" for e in layout.entries) == 14  # 7 decoder linears x 2 layers
    _spawn(_two_ranks, 2, _free_port(), layout, tmp_path)
    sender, receiver = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    _assert_bit_identical(receiver["received"], expected)
    _assert_bit_identical(receiver["into"], expected)
    assert "layout differs" in receiver["receiver_error"] and "another rank failed" in sender["sender_error"]
    assert "expects 99" in receiver["version_error"] and "another rank failed" in sender["push_error"]
    assert "differ from the sender's bytes" in receiver["clobber_error"]
    assert "model.embed_tokens.weight" in receiver["clobber_error"]
    assert "another rank's weights differ" in sender["clobber_error"]
    bf16_bytes = sum(v.numel() * 2 for v in _weights()[0].values())
    assert sender["stats"]["bytes_sent"] == layout.nbytes < 0.8 * bf16_bytes
    for stats in (sender["stats"], receiver["stats"]):
        assert stats["version"] == 3 and stats["verified"] and stats["tensors"] == len(layout)


def _three_ranks(rank: int, port: int, layout: SyncLayout, out_dir: Path) -> None:
    """A group of its own (``new_sync_group``); rank 0 pushes to two rollout engines."""
    torch.set_num_threads(1)
    group = new_sync_group(f"tcp://127.0.0.1:{port}", rank, 3, "gloo", timeout_s=COLLECTIVE_TIMEOUT_S)
    res: dict[str, Any] = {}
    if rank == 0:
        weights, fp8 = _weights()
        sync = CollectiveSender(fp8, SPEC, device="cpu", group=group, bucket_bytes=4 * SMALL_BUCKET, verify=True)
        assert sync.layout(weights) == layout
        res["v1"] = dataclasses.asdict(sync.broadcast(weights, 1))
        res["v2_error"] = _error(sync.broadcast, weights, 2)
        res["v3"] = dataclasses.asdict(sync.broadcast(_weights(seed=2)[0], 3))  # the group survives a failed push
    else:
        engine = _engine()
        receive_into(engine, layout, 1, device="cpu", group=group)
        verify_engine_weights(engine, _expected(), 1)
        # rank 2 now holds a bf16 engine, which refuses FP8 weights: every rank raises, none hangs
        res["v2_error"] = _error(
            receive_into, engine if rank == 1 else _engine("bf16"), layout, 2, device="cpu", group=group
        )
        res["v3"] = dataclasses.asdict(receive_into(engine, layout, 3, device="cpu", group=group))
        verify_engine_weights(engine, _expected(seed=2), 3)
        assert engine.policy_version == 3
    torch.save(res, out_dir / f"rank{rank}.pt")


def test_three_processes_one_sender_two_engines_with_failure_and_recovery(tmp_path: Path) -> None:
    layout = layout_of(_expected())
    _spawn(_three_ranks, 3, _free_port(), layout, tmp_path)
    sender, r1, r2 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(3))
    assert sender["v1"]["verified"] and sender["v3"]["version"] == 3
    assert "ValueError" in r2["v2_error"] and "held in bf16" in r2["v2_error"]
    assert "another rank failed" in r1["v2_error"] and "another rank failed" in sender["v2_error"]
    assert r1["v3"]["verified"] and r2["v3"]["verified"]
