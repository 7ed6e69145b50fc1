"""The RL step's Ray actors: trainer workers (data parallel) and rollout workers.

These are plain classes; ``fp8rl.cluster.driver`` turns them into actors with ``ray.remote``
and places them.  Each holds the same objects the one-process loop holds (``TorchTrainer``,
``TorchRolloutEngine``), so an actor computes exactly what ``fp8rl.loop`` computes.

Data parallelism.  Replicated (``ray.trainer_sharding: replicate``), every trainer worker holds a
full replica.  The driver gives rank r the
r-th contiguous slice of the batch plus the batch's global token/sequence totals; each rank
accumulates the gradient of its exact share of the global loss, and ``all_reduce(SUM)``
over the fp32 master gradients (gloo on CPU, NCCL on GPU) gives every rank the full-batch
gradient before the identical clip and AdamW step (the DDP recipe, by hand: the model's
parameters are bf16 with fp32 masters, which DDP's hooks do not know about).  Sharded
(``fsdp``), FSDP2 holds 1/world of the fp32 masters and AdamW state on each rank and
reduce-scatters the same summed gradient; whatever needs the full weights (the rollout
payload, the collective push, the trainer state, the saved policy) is then a collective that
every rank joins and rank 0 answers (the others return None).

Weight sync.  The actors' calls are the same for every ``ray.sync`` transport and delegate to it: the driver has
every trainer rank build the transport's sender (``init_sender``) and every rollout worker its receiver
(``init_receiver``); each push is ``send_weights`` on the trainer ranks that send, ``receive_weights`` on the
rollout workers with what the senders returned (or the agreed layout), and ``sync_done`` where the sender holds
memory for the receivers.  The transports, their senders and receivers and the driver's push are ``fp8rl.sync``'s
``objectstore``, ``collective`` and ``ipc`` modules.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Literal

import torch
import torch.distributed as dist

from fp8rl.build import build_engine, build_trainer, rollout_quant_spec
from fp8rl.cluster.memory import PeakMemorySampler, gpu_key, gpu_sampler
from fp8rl.config import parse_run_config
from fp8rl.config.run import SyncTransport
from fp8rl.rollout.base import Rollout, SamplingParams
from fp8rl.rollout.kv_calibration import KVScales
from fp8rl.sync import transport
from fp8rl.sync.base import Receiver, Sender
from fp8rl.train.old_logprobs import PolicyStep
from fp8rl.train.trainer import SequenceBatch

# gloo/NCCL collectives give up after this long rather than hang on a dead peer
COLLECTIVE_TIMEOUT_S = 300


def node_address() -> tuple[str, int]:
    """This node's IP and a free TCP port on it (a process-group rendezvous)."""
    import socket

    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def _backend(device: torch.device) -> Literal["nccl", "gloo"]:
    return "nccl" if device.type == "cuda" else "gloo"


def _set_threads(num_threads: int) -> None:
    if num_threads > 0:
        torch.set_num_threads(num_threads)


class _PeakMemory:
    """The peak used memory of this actor's GPU (``fp8rl.cluster.memory``); nothing on CPU actors."""

    _sampler: PeakMemorySampler | None = None
    _gpu: str = ""

    def _start_sampler(self, device: torch.device) -> None:
        if device.type == "cuda":
            index = device.index or 0
            self._sampler, self._gpu = gpu_sampler(index), gpu_key(index)

    def gpu_peak(self, reset: bool = False) -> dict[str, int] | None:
        """``{GPU UUID: most bytes in use}`` since the start or the last reset; None without a sampler."""
        if self._sampler is None:
            return None
        return {self._gpu: self._sampler.peak(reset)}


class TrainerWorker(_PeakMemory):
    """One data-parallel rank of the trainer."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        init_method: str,
        cfg_data: dict[str, Any],
        model_dir: str,
        device: str = "cpu",
        num_threads: int = 0,
    ) -> None:
        _set_threads(num_threads)
        self.rank, self.world_size = rank, world_size
        self.cfg = parse_run_config(cfg_data, "trainer worker config")
        sharded = self.cfg.ray is not None and self.cfg.ray.trainer_sharding == "fsdp"
        if world_size > 1 or sharded:
            if device.startswith("cuda"):
                torch.cuda.set_device(torch.device(device).index or 0)
            dist.init_process_group(
                _backend(torch.device(device)),
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            )
        self._start_sampler(torch.device(device))
        self.trainer = build_trainer(self.cfg, model_dir, device)
        self.sharded = self.trainer.sharded
        self.colocated = self.cfg.ray is not None and self.cfg.ray.layout == "colocated"
        self.sender: Sender | None = None  # the weight sync's (init_sender)
        if world_size > 1 and not self.sharded:
            self.trainer.optimizer.grad_reducer = self._sum_across_ranks

    def _sum_across_ranks(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def ready(self) -> int:
        return self.rank

    def compute_logprobs(self, batch: SequenceBatch, temperature: float) -> torch.Tensor:
        return self.trainer.compute_logprobs(batch, temperature)

    def policy_step(self, step: PolicyStep) -> dict[str, float]:
        metrics = self.trainer.policy_step(step)
        self._hand_back_cached_memory()
        return metrics

    def profile_next_policy_step(self) -> None:
        self.trainer.profile_next_policy_step()

    def _hand_back_cached_memory(self) -> None:
        """Colocated on a GPU, the engine wakes up next: the blocks this rank's caching allocator holds
        but no tensor uses (activations, gathered weights) go back to the driver so vLLM can take them."""
        if self.colocated and self.trainer.device.type == "cuda":
            torch.cuda.empty_cache()

    def _full_weights(self, answering: int = 1) -> dict[str, torch.Tensor] | None:
        """The full bf16 weights on the ranks that answer (0 .. ``answering``-1), None on the others; sharded,
        every rank joins the gather and only the answering ranks keep what it gathers."""
        answers = self.rank < answering
        if self.sharded:
            weights = self.trainer.hf_state_dict(keep=answers)
            return weights if answers else None
        return self.trainer.hf_state_dict() if answers else None

    def init_sender(self, sync: SyncTransport, fp8_names: list[str], verify: bool, options: dict[str, Any]) -> Any:
        """Build the sender of the transport ``sync`` (``fp8rl.sync.transport``); returns what it answers (the
        collective one: the payload's layout, from rank 0)."""
        built = transport(sync).sender(
            fp8_names, rollout_quant_spec(self.cfg), self.trainer.device, verify, self._full_weights, **options
        )
        self.sender, answer = built
        return answer

    def send_weights(self, version: int) -> Any:
        """This rank's part of a push: what the transport's sender returns (None on a rank that does not answer)."""
        assert self.sender is not None, "init_sender first"
        return self.sender.send(self._full_weights, version)

    def sync_done(self) -> None:
        """The receivers have loaded the push."""
        assert self.sender is not None, "init_sender first"
        self.sender.done()

    def free_address(self) -> tuple[str, int]:
        """The rendezvous of a process group this rank will lead (the collective weight sync's)."""
        return node_address()

    def kv_scales(self, batch: SequenceBatch) -> tuple[dict[int, KVScales], float] | None:
        """FP8 KV-cache scales of this policy over ``batch`` and the seconds they took, from rank 0 (sharded,
        every rank runs the forward)."""
        if not (self.sharded or self.rank == 0):
            return None
        r = self.cfg.rollout
        answer = self.trainer.kv_scales(batch, r.kv_scale_quantile, r.kv_scale_margin)
        return answer if self.rank == 0 else None

    def fp8_module_count(self) -> int:
        return len(self.trainer.fp8_modules)

    def bf16_bytes(self) -> int:
        return sum(p.numel() * 2 for p in self.trainer.model.parameters())  # a DTensor's numel is the full one

    def memory(self) -> dict[str, float]:
        """This rank's training state in bytes: bf16 weights (replicated only; sharded, they exist while a unit is
        gathered), fp32 masters, and AdamW's two fp32 moments (made at the first step; in host memory between
        steps when ``optimizer_state_offloaded`` is 1)."""
        from torch.distributed.tensor import DTensor

        opt = self.trainer.optimizer
        local = sum(m.to_local().numel() if isinstance(m, DTensor) else m.numel() for m in opt.master)
        params = 0 if self.sharded else sum(p.numel() * p.element_size() for p in self.trainer.model.parameters())
        return {
            "param_bytes": float(params), "master_bytes": 4.0 * local, "optimizer_state_bytes": 8.0 * local,
            "optimizer_state_offloaded": float(opt.offload is not None),
        }  # fmt: skip

    def state_dict(self) -> dict[str, Any] | None:
        """The full trainer state from rank 0 (sharded: gathered by every rank)."""
        if self.sharded or self.rank == 0:
            state = self.trainer.state_dict()
            return state if self.rank == 0 else None
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)

    def save_policy(self, output_dir: str, tokenizer_dir: str) -> None:
        from fp8rl.models.loading import load_tokenizer

        self.trainer.save_checkpoint(output_dir, load_tokenizer(tokenizer_dir))

    def pid(self) -> int:
        return os.getpid()


class RolloutWorker(_PeakMemory):
    """One rollout engine; generation for its share of the prompts."""

    def __init__(
        self,
        cfg_data: dict[str, Any],
        model_dir: str,
        device: str = "cpu",
        num_threads: int = 0,
        tp_rank: int = 0,
        tp_address: tuple[str, int] | None = None,
    ) -> None:
        _set_threads(num_threads)
        self.cfg = parse_run_config(cfg_data, "rollout worker config")
        self._start_sampler(torch.device(device))
        tp = self.cfg.rollout.tensor_parallel_size
        if tp > 1:  # rank tp_rank of a tensor-parallel engine: what vLLM's external_launcher reads (torchrun's names)
            if tp_address is None:
                raise ValueError("a tensor-parallel rollout worker needs its group's rendezvous address")
            os.environ.update({
                "RANK": str(tp_rank), "WORLD_SIZE": str(tp), "LOCAL_RANK": "0",  # Ray shows each actor its GPU as 0
                "MASTER_ADDR": tp_address[0], "MASTER_PORT": str(tp_address[1]),
                # vLLM's torch symmetric-memory all-reduce (on by default) maps peer memory and may use NVLink
                # multicast; NCCL's all-reduce needs neither
                "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
            })  # fmt: skip
        self.engine = build_engine(self.cfg, model_dir, device)

    def fp8_weight_names(self) -> list[str]:
        return [m + ".weight" for m in self.engine.fp8_modules]

    def pad_token_id(self) -> int:
        return self.engine.pad_token_id

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> Rollout:
        return self.engine.generate(prompt_ids, sampling)

    def init_receiver(self, sync: SyncTransport, verify: bool, options: dict[str, Any]) -> None:
        """Build the receiver of the transport ``sync`` (``fp8rl.sync.transport``) around this engine."""
        self.receiver: Receiver = transport(sync).receiver(self.engine, verify, **options)

    def receive_weights(self, message: Any, version: int) -> Any:
        """Load one push into the engine in place as policy ``version``; what the transport's receiver returns."""
        return self.receiver.receive(message, version)

    def set_kv_scales(self, scales: dict[int, KVScales]) -> None:
        """The FP8 KV-cache scales the trainer calibrated (vLLM engine with ``kv_cache: fp8``)."""
        set_scales = getattr(self.engine, "set_kv_scales", None)
        if set_scales is None:
            raise RuntimeError(
                f"{type(self.engine).__name__} has no FP8 KV cache (kv_cache fp8 needs rollout.engine vllm)"
            )
        set_scales(scales)

    def policy_version(self) -> int:
        return self.engine.policy_version

    def sleep(self) -> int | None:
        """Sleep; returns the device memory it freed where the engine measures it (vLLM), else None."""
        self.engine.sleep()
        return getattr(self.engine, "sleep_freed_bytes", None)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def is_asleep(self) -> bool:
        return self.engine.asleep

    def pid(self) -> int:
        return os.getpid()
