"""``rollout.tensor_parallel_size``: one vLLM engine over several Ray rollout workers (vLLM's external_launcher).

What runs here: the configuration's checks; the engine arguments; which part of each weight a rank holds and how
fp8rl reads it back under HF names for the bit-exact sync check (``fused_layout(cfg, tp)``, ``unfuse_params``,
``fp8rl.rollout.vllm_tp.tp_shard``) against a rank's parameters built here from vLLM's sharding rules (column-parallel q/k/v and gate/up
split by rows and then fused, row-parallel o/down split by columns, vocabulary rows in blocks of the padded
vocabulary; FP8 bytes and scales split as loaded, never requantized), not from fp8rl's code; the verify that uses
it; and how the rollout group feeds and reads a tensor-parallel engine's workers.  vLLM itself, the launcher's
rendezvous and NCCL between the workers need two GPUs: ``tests/gpu/test_ray_vllm.py``'s tensor-parallel case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from transformers import LlamaForCausalLM

from fp8rl.cluster.groups import RolloutGroup, WorkerError
from fp8rl.config import ConfigError, RolloutConfig, load_recipe, parse_run_config
from fp8rl.models.tiny import TinyPreset, _config
from fp8rl.quant import QuantizedTensor, QuantSpec
from fp8rl.rollout import vllm_engine as ve
from fp8rl.rollout import vllm_tp as vtp
from fp8rl.rollout import vllm_weights as vw
from fp8rl.rollout.base import Rollout, SamplingParams
from fp8rl.sync import requantize_for_rollout
from fp8rl.sync.base import SyncVerificationError, verify_engine_weights

PRESET = TinyPreset(512, 1024, 2, 8, 4)  # hidden, intermediate, layers, heads, KV heads: whole 128-tiles at tp 2


def _model() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(PRESET)).to(torch.bfloat16)
    return {n: p.detach() for n, p in model.named_parameters()}, model.config.to_dict()


def _rank_params(payload: dict[str, Any], cfg: dict[str, Any], rank: int, tp: int, pad_vocab: int) -> dict[str, Any]:
    """What rank ``rank`` of a ``tp``-way vLLM engine holds after loading ``payload`` (HF names, full tensors)."""

    def rows(t: torch.Tensor, unit: int = 1) -> torch.Tensor:
        n = t.shape[0] * unit // tp
        return t[rank * n // unit : (rank + 1) * n // unit]

    def cols(t: torch.Tensor, unit: int = 1) -> torch.Tensor:
        n = t.shape[1] * unit // tp
        return t[:, rank * n // unit : (rank + 1) * n // unit]

    out: dict[str, Any] = {}

    def put(module: str, parts: list[Any], split: str) -> None:
        cut = rows if split == "rows" else cols
        if isinstance(parts[0], QuantizedTensor):
            q = parts[0]
            data = torch.cat([cut(p.data) for p in parts])
            if q.granularity == "block":
                out[f"{module}.weight"] = data
                out[f"{module}.weight_scale_inv"] = torch.cat([cut(p.scale_inv, 128) for p in parts])
            else:  # compressed-tensors per channel: the weight held transposed, scales split with the rows only
                out[f"{module}.weight"] = data.t()
                scales = [rows(p.scale_inv) if split == "rows" else p.scale_inv for p in parts]
                out[f"{module}.weight_scale"] = torch.cat(scales)
        else:
            out[f"{module}.weight"] = torch.cat([cut(p) for p in parts])

    packed = {"self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"], "mlp.gate_up_proj": ["gate_proj", "up_proj"]}
    for i in range(cfg["num_hidden_layers"]):
        for fused, parts in packed.items():
            sub = fused.split(".")[0]
            put(f"model.layers.{i}.{fused}", [payload[f"model.layers.{i}.{sub}.{p}.weight"] for p in parts], "rows")
        for module in ("self_attn.o_proj", "mlp.down_proj"):
            put(f"model.layers.{i}.{module}", [payload[f"model.layers.{i}.{module}.weight"]], "cols")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{i}.{norm}.weight"] = payload[f"model.layers.{i}.{norm}.weight"]
    out["model.norm.weight"] = payload["model.norm.weight"]
    for name in vw.VOCAB_PARAMS:
        w = payload[name]
        padded = torch.cat([w, torch.zeros(pad_vocab, w.shape[1], dtype=w.dtype)])
        out[name] = rows(padded)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
        return torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale_inv, b.scale_inv)
    return not isinstance(a, QuantizedTensor) and not isinstance(b, QuantizedTensor) and torch.equal(a, b)


@pytest.mark.parametrize("granularity", ["block", "row", "bf16"])
@pytest.mark.parametrize("pad_vocab", [0, 64, 192])  # 192: rank 1 of 2 holds only padding rows
def test_each_rank_reads_back_its_part_of_the_pushed_weights(granularity: str, pad_vocab: int) -> None:
    hf, cfg = _model()
    fp8 = set() if granularity == "bf16" else {n for n in hf if n.endswith("_proj.weight")}
    spec = QuantSpec(granularity="block" if granularity == "bf16" else granularity)  # type: ignore[arg-type]
    payload = requantize_for_rollout(hf, fp8, spec)
    tp = 2
    layout = vw.fused_layout(cfg, tp)
    assert vtp.tp_layout_problem(cfg, tp, block_fp8=granularity == "block") is None
    for rank in range(tp):
        params = _rank_params(payload, cfg, rank, tp, pad_vocab)
        held = vw.unfuse_params(params, layout, cfg["vocab_size"], rank)
        assert set(held) == set(payload)
        padded = params["model.embed_tokens.weight"].shape[0] * tp
        bad = [n for n in payload if not _same(held[n], vtp.tp_shard(n, payload[n], rank, tp, padded))]
        assert not bad, bad[:4]
    # the parts cover each weight once: the ranks' q rows and o columns together are the whole
    parts = [vtp.tp_shard("model.layers.0.self_attn.o_proj.weight", payload["model.layers.0.self_attn.o_proj.weight"],
                         r, tp) for r in range(tp)]  # fmt: skip
    whole = payload["model.layers.0.self_attn.o_proj.weight"]
    if isinstance(whole, QuantizedTensor):
        assert torch.equal(torch.cat([p.data for p in parts], 1).view(torch.uint8), whole.data.view(torch.uint8))
    else:
        assert torch.equal(torch.cat(parts, 1), whole)


def test_the_vocabulary_split_needs_the_padded_size() -> None:
    hf, _ = _model()
    with pytest.raises(ValueError, match="padded vocabulary size"):
        vtp.tp_shard("lm_head.weight", hf["lm_head.weight"], 0, 2)


def test_layout_problems_name_the_field() -> None:
    _, cfg = _model()
    assert "num_key_value_heads (4)" in (vtp.tp_layout_problem(cfg, 8, block_fp8=False) or "")
    assert "whole 128-wide block-FP8 tiles" in (vtp.tp_layout_problem(cfg, 4, block_fp8=True) or "")
    assert vtp.tp_layout_problem(cfg, 4, block_fp8=False) is None  # per channel: no tile constraint
    assert vtp.tp_layout_problem(cfg, 1, block_fp8=True) is None


class _Engine:
    """A tensor-parallel engine at the verify's boundary: what it holds and which part of a weight is its own."""

    def __init__(self, held: dict[str, Any], rank: int, tp: int, padded: int) -> None:
        self.held, self.rank, self.tp, self.padded, self.policy_version = held, rank, tp, padded, 3

    def held_weights(self) -> dict[str, Any]:
        return self.held

    def expected_shard(self, name: str, value: Any) -> Any:
        return vtp.tp_shard(name, value, self.rank, self.tp, self.padded)


def test_verify_compares_each_rank_with_its_part_and_catches_a_wrong_one() -> None:
    hf, cfg = _model()
    fp8 = {n for n in hf if n.endswith("_proj.weight")}
    payload = requantize_for_rollout(hf, fp8, QuantSpec())
    params = _rank_params(payload, cfg, 1, 2, 64)
    held = vw.unfuse_params(params, vw.fused_layout(cfg, 2), cfg["vocab_size"], 1)
    engine = _Engine(held, 1, 2, params["model.embed_tokens.weight"].shape[0] * 2)
    verify_engine_weights(engine, payload, 3)  # type: ignore[arg-type]
    engine.rank = 0  # rank 0's part of every split weight is not what this rank holds
    with pytest.raises(SyncVerificationError, match="differs from the pushed weight"):
        verify_engine_weights(engine, payload, 3)  # type: ignore[arg-type]


def _ray_cfg(**rollout: Any) -> dict[str, Any]:
    return {"recipe": load_recipe("fp8-e2e").model_dump(), "rollout": {"engine": "vllm", **rollout},
            "ray": {"rollout_workers": 2, "trainer_workers": 2, "trainer_sharding": "fsdp", "sync": "ipc",
                    "layout": "colocated"}}  # fmt: skip


def test_config_checks_name_the_fields() -> None:
    cfg = parse_run_config(_ray_cfg(tensor_parallel_size=2), "t")
    assert cfg.rollout.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size 2 splits a vLLM engine over Ray"):
        parse_run_config({**_ray_cfg(tensor_parallel_size=2), "ray": None}, "t")
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size 2 splits a vLLM engine over Ray"):
        parse_run_config({**_ray_cfg(tensor_parallel_size=2), "rollout": {"tensor_parallel_size": 2}}, "t")
    collective = _ray_cfg(tensor_parallel_size=2)
    collective["ray"] = {**collective["ray"], "sync": "collective"}
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size 2 needs ray.sync 'ipc' or 'objectstore'"):
        parse_run_config(collective, "t")
    with pytest.raises(ConfigError, match=r"ray.rollout_workers \(2\) must be a multiple of"):
        parse_run_config(_ray_cfg(tensor_parallel_size=4), "t")
    with pytest.raises(ValidationError, match="tensor_parallel_size"):
        RolloutConfig(tensor_parallel_size=0)


def test_engine_kwargs_launch_each_rank_in_its_own_process() -> None:
    one = ve.vllm_engine_kwargs("/m", load_recipe("bf16"), RolloutConfig())
    assert "tensor_parallel_size" not in one and "distributed_executor_backend" not in one
    two = ve.vllm_engine_kwargs("/m", load_recipe("bf16"), RolloutConfig(tensor_parallel_size=2))
    assert two["tensor_parallel_size"] == 2 and two["distributed_executor_backend"] == "external_launcher"
    assert two["disable_custom_all_reduce"]


# ---- the rollout group: Ray actors at the boundary (the calls return their values; no Ray here) ------------
@dataclass
class _Call:
    fn: Any

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class _Worker:
    def __init__(self, log: list[tuple[int, list[list[int]], int]], index: int, shift: int = 0) -> None:
        self.generate = _Call(lambda prompts, params: self._generate(prompts, params))
        self.log, self.index, self.shift = log, index, shift

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        self.log.append((self.index, prompts, params.seed))
        ids = torch.tensor([[p[0] + params.seed + self.shift] for p in prompts])
        ones = torch.ones(len(prompts), 1)
        return Rollout(prompts, ids, ones, ones * 0, torch.zeros(len(prompts), dtype=torch.bool), 0)


class _Calls:
    def get(self, refs: Any, what: Any) -> Any:
        return refs


def test_each_engine_gets_a_chunk_and_all_its_workers_the_same_requests() -> None:
    log: list[tuple[int, list[list[int]], int]] = []
    workers = [_Worker(log, i) for i in range(4)]
    group = RolloutGroup(workers, _Calls(), False, 0, names=[f"rollout-{i}" for i in range(4)], tp=2)  # type: ignore[arg-type]
    prompts = [[10], [20], [30], [40], [50]]
    out = group.generate(prompts, SamplingParams(seed=1))
    assert [(i, p) for i, p, _ in log] == [(0, prompts[:3]), (1, prompts[:3]), (2, prompts[3:]), (3, prompts[3:])]
    assert log[0][2] == log[1][2] != log[2][2] == log[3][2]  # a seed per engine, shared by its workers
    assert out.prompt_ids == prompts and out.response_ids.shape == (5, 1)


def test_workers_of_one_engine_that_sample_differently_fail_the_step() -> None:
    log: list[tuple[int, list[list[int]], int]] = []
    workers = [_Worker(log, 0), _Worker(log, 1, shift=1)]
    group = RolloutGroup(workers, _Calls(), False, 0, names=["rollout-0", "rollout-1"], tp=2)  # type: ignore[arg-type]
    with pytest.raises(WorkerError, match="rollout-1 sampled other tokens than rollout-0"):
        group.generate([[1], [2]], SamplingParams())
