"""Time the broadcast weight sync, trainer GPU -> rollout GPU, for a ~1.8B model: BF16 bytes vs FP8 bytes.

Rank 0 (the trainer) holds random bf16 weights with the shapes of a Qwen2-1.5B-style model
(hidden 1536, intermediate 8960, 28 layers, 12 query heads and 2 key/value heads of 128,
vocab 151936, q/k/v biases, an untied lm_head: 1.78B parameters).  For each precision --
``bf16`` (every tensor bf16) and ``fp8`` (the 196 decoder linears block-FP8 128x128, the rest
bf16) -- it times the requantization on rank 0, then ``fp8rl.sync.nccl.broadcast_payload``
to the other ranks, which unpack every bucket into preallocated tensors (as an engine loads
in place).  Each timing is the median over ``--reps`` repetitions after a warm-up, each
between a barrier and ``synchronize`` on every rank, the slowest rank counting.  A plain
broadcast of one buffer of the same size gives the link's ceiling.  A last verified push
checks the received bytes against the sender's checksums.

Usage, on a machine with 2 GPUs (NCCL):   python3 experiments/gpu_sync_bench.py
                                     or:  torchrun --nproc-per-node 2 experiments/gpu_sync_bench.py
CPU smoke run (gloo, a small model):      python experiments/gpu_sync_bench.py --backend gloo --small
Prints a table and writes $OUT/gpu_sync_bench.json (OUT defaults to '.').
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8rl.quant import QuantizedTensor, QuantSpec
from fp8rl.sync.buckets import empty_payload, layout_of, plan_buckets
from fp8rl.sync.inprocess import Payload, SyncVerificationError, payload_bytes, requantize_for_rollout
from fp8rl.sync.nccl import SyncGroup, broadcast_payload, new_sync_group

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def state_dict_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF Qwen2 names and shapes, in the order a state dict lists them."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, self.hidden)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out |= {
                p + "self_attn.q_proj.weight": (q, self.hidden),
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.weight": (kv, self.hidden),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, self.hidden),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (self.hidden, q),
                p + "mlp.gate_proj.weight": (self.intermediate, self.hidden),
                p + "mlp.up_proj.weight": (self.intermediate, self.hidden),
                p + "mlp.down_proj.weight": (self.hidden, self.intermediate),
                p + "input_layernorm.weight": (self.hidden,),
                p + "post_attention_layernorm.weight": (self.hidden,),
            }
        out |= {"model.norm.weight": (self.hidden,), "lm_head.weight": (self.vocab, self.hidden)}
        return out

    def fp8_names(self) -> set[str]:
        return {f"model.layers.{i}.{m}.weight" for i in range(self.layers) for m in LINEARS}


QWEN2_1_5B = ModelShape(1536, 8960, 28, 12, 2, 128, 151936)
SMALL = ModelShape(256, 512, 2, 2, 1, 128, 2048)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(group: SyncGroup, device: torch.device) -> None:
    _sync(device)
    group.allreduce([torch.zeros(1, device=device)]).wait()
    _sync(device)


def _slowest(group: SyncGroup, device: torch.device, seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    group.allreduce([t], torch.distributed.ReduceOp.MAX).wait()
    return float(t.item())


def _share(obj: Any, group: SyncGroup, device: torch.device) -> Any:
    """Rank 0's picklable ``obj`` on every rank (the side channel that hands over the layout)."""
    data = pickle.dumps(obj) if group.rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    group.broadcast(size, 0).wait()
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if group.rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    group.broadcast(buf, 0).wait()
    return pickle.load(io.BytesIO(buf.cpu().numpy().tobytes()))


def _timed(fn: Any, group: SyncGroup, device: torch.device, reps: int) -> list[float]:
    """Seconds of ``fn()`` on the slowest rank, after one warm-up, ``reps`` times."""
    fn()
    times = []
    for _ in range(reps):
        _barrier(group, device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(_slowest(group, device, time.perf_counter() - t0))
    return times


def _requantize_seconds(weights: dict[str, torch.Tensor], fp8: set[str], device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        requantize_for_rollout(weights, fp8, QuantSpec())
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _raw_broadcast_seconds(nbytes: int, group: SyncGroup, device: torch.device, reps: int) -> list[float]:
    """The link's ceiling: one broadcast of a single buffer as large as the payload."""
    raw = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return _timed(lambda: group.broadcast(raw, 0).wait(), group, device, reps)


def bench_precision(
    precision: str,
    shape: ModelShape,
    weights: dict[str, torch.Tensor] | None,
    args: argparse.Namespace,
    group: SyncGroup,
) -> list[dict[str, Any]]:
    device, rank = args.device, group.rank()
    fp8 = shape.fp8_names() if precision == "fp8" else set()
    payload, requant_s = None, 0.0
    if rank == 0:
        assert weights is not None
        requant_s = _requantize_seconds(weights, fp8, device, args.reps)
        payload = requantize_for_rollout(weights, fp8, QuantSpec())
        _sync(device)
    layout = _share(layout_of(payload) if payload is not None else None, group, device)
    into = None if rank == 0 else empty_payload(layout, device)
    raw_times = _raw_broadcast_seconds(layout.nbytes, group, device, args.reps)
    rows = []
    for bucket_mb in args.bucket_mb:
        bucket = int(bucket_mb * 1024 * 1024)

        def push(verify: bool = False, bucket: int = bucket) -> None:
            broadcast_payload(payload, layout, 0, group, device, bucket, into=into, verify=verify)

        times = _timed(push, group, device, args.reps)
        if into is not None:  # the verified push must write every byte again to pass
            _scramble(into)
        try:
            push(verify=True)
            bit_exact = True
        except SyncVerificationError:
            bit_exact = False
        seconds = statistics.median(times)
        rows.append(
            {
                "precision": precision,
                "bucket_mb": bucket_mb,
                "bytes": layout.nbytes,
                "tensors": len(layout),
                "fp8_tensors": sum(e.kind == "fp8" for e in layout.entries),
                "buckets": len(plan_buckets(layout, bucket)),
                "requantize_s": requant_s,
                "broadcast_s": seconds,
                "broadcast_s_all": times,
                "gbps": layout.nbytes / seconds / 1e9,
                "raw_broadcast_s": statistics.median(raw_times),
                "raw_gbps": layout.nbytes / statistics.median(raw_times) / 1e9,
                "bit_exact": bit_exact,
            }
        )
    if payload is not None:
        assert payload_bytes(payload) == layout.nbytes
    return rows


def _scramble(payload: Payload) -> None:
    for v in payload.values():
        for t in (v.data, v.scale_inv) if isinstance(v, QuantizedTensor) else (v,):
            t.view(torch.uint8).fill_(0xA5)


def _random_weights(shape: ModelShape, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        name: (torch.randn(s, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        for name, s in shape.state_dict_shapes().items()
    }


def _print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'precision':>9} {'bucket MB':>9} {'GB sent':>8} {'buckets':>7} {'requant s':>9} {'sync s':>8}"
    print(head + f" {'GB/s':>7} {'raw GB/s':>8} {'bit-exact':>9}")
    for r in rows:
        print(
            f"{r['precision']:>9} {r['bucket_mb']:>9g} {r['bytes'] / 1e9:>8.3f} {r['buckets']:>7} "
            f"{r['requantize_s']:>9.4f} {r['broadcast_s']:>8.4f} {r['gbps']:>7.1f} {r['raw_gbps']:>8.1f} "
            f"{r['bit_exact']!s:>9}"
        )


def worker(rank: int, world_size: int, init_method: str, args: argparse.Namespace) -> None:
    if args.backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        args.device = torch.device("cuda", local)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
        args.device = torch.device("cpu")
    group = new_sync_group(init_method, rank, world_size, args.backend, timeout_s=300)
    shape = SMALL if args.small else QWEN2_1_5B
    weights = _random_weights(shape, args.device) if rank == 0 else None
    rows = [row for p in ("bf16", "fp8") for row in bench_precision(p, shape, weights, args, group)]
    if rank != 0:
        return
    _print_table(rows)
    by = {r["precision"]: r for r in rows if r["bucket_mb"] == args.bucket_mb[0]}
    summary = {
        "device": torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "nccl": str(torch.cuda.nccl.version()) if args.backend == "nccl" else None,
        "backend": args.backend,
        "world_size": world_size,
        "model": asdict(shape),
        "parameters": sum(w.numel() for w in (weights or {}).values()),
        "reps": args.reps,
        "fp8_bytes_vs_bf16": by["fp8"]["bytes"] / by["bf16"]["bytes"],
        "fp8_sync_time_vs_bf16": by["fp8"]["broadcast_s"] / by["bf16"]["broadcast_s"],
        "results": rows,
    }
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_sync_bench.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=2))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--small", action="store_true", help="a 2-layer model (smoke run)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--bucket-mb", type=lambda s: [float(x) for x in s.split(",")], default=[256.0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    args = parser.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args)
    else:
        init = f"tcp://127.0.0.1:{_free_port()}"
        mp.start_processes(worker, args=(args.world_size, init, args), nprocs=args.world_size, start_method="spawn")


if __name__ == "__main__":
    main()
