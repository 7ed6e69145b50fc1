"""``optim.cuda_graphs`` on the CPU: what the option needs, and the micro-batch shape buckets it pads to.

The graphs themselves need a GPU (``tests/gpu/test_cuda_graphs_trainer.py``); the padding and the micro-batch
cut are plain tensor code, so here the bucketing is switched on by itself (the trainer's
``MicroBatcher.width_step``) and the padded forwards are compared with the unpadded ones on a real (tiny) Llama.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fp8rl.build import trainer_options
from fp8rl.config import GRPOConfig, OptimConfig, RunConfig, load_recipe
from fp8rl.train.graphs import LayerGraphs
from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld
from fp8rl.train.trainer import TorchTrainer, TrainerOptions, build_batch


def _batch(rows: int = 7, vocab: int = 40) -> tuple:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (4 + i % 3,), generator=g).tolist() for i in range(rows)]
    responses = torch.randint(3, vocab, (rows, 9), generator=g)
    mask = torch.ones(rows, 9)
    mask[1, 5:] = 0
    mask[4, 2:] = 0
    return build_batch(prompts, responses, mask, pad_id=0), mask


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({}, r"optim\.cuda_graphs needs a CUDA device; this trainer runs on 'cpu'"),
        ({"backend": "te"}, r"optim\.cuda_graphs needs trainer 'torch', got 'te'"),
        ({"sharding": "fsdp"}, r"optim\.cuda_graphs cannot be combined with ray\.trainer_sharding 'fsdp'"),
        ({"optim": {"activation_checkpointing": True}}, r"cannot be combined with optim\.activation_checkpointing"),
    ],
)
def test_cuda_graphs_refuse_what_they_cannot_capture(tiny_models: dict[str, Path], options, error) -> None:
    with pytest.raises(ValueError, match=error):
        optim = OptimConfig(cuda_graphs=True, lr=2e-5, warmup_steps=0, **options.get("optim", {}))
        rest = {k: v for k, v in options.items() if k != "optim"}
        TorchTrainer(tiny_models["tiny"], TrainerOptions(optim=optim, **rest), device="cpu")


def test_run_config_carries_the_cuda_graph_options() -> None:
    recipe = load_recipe("fp8-e2e")
    optim = {"cuda_graphs": True, "cuda_graph_width": 128, "cuda_graph_shapes": 3}
    o = trainer_options(RunConfig.model_validate({"recipe": recipe, "optim": optim}))
    assert (o.optim.cuda_graphs, o.optim.cuda_graph_width, o.optim.cuda_graph_shapes) == (True, 128, 3)
    assert not trainer_options(RunConfig.model_validate({"recipe": recipe})).optim.cuda_graphs  # off by default
    with pytest.raises(ValueError, match="cuda_graph_width"):
        RunConfig.model_validate({"recipe": recipe, "optim": {"cuda_graph_width": 0}})


@pytest.mark.parametrize("budget", [None, 48])
def test_bucketed_micro_batches_give_the_unpadded_logprobs_and_loss(tiny_models: dict[str, Path], budget) -> None:
    batch, mask = _batch()
    opts = TrainerOptions(optim=OptimConfig(lr=1e-3, micro_batch_size=3, micro_batch_tokens=budget, warmup_steps=0))
    plain = TorchTrainer(tiny_models["tiny"], opts, device="cpu")
    padded = TorchTrainer(tiny_models["tiny"], opts, device="cpu")
    padded.micro = replace(padded.micro, width_step=8)  # what cuda_graph_width does, without the graphs (GPU only)

    slices = padded.micro.slices(batch)
    assert sum(len(range(len(mask))[s]) for s in slices) == len(mask)
    for sl in slices:
        b = batch.slice(sl).trimmed()
        width = b.input_ids.shape[1]
        bucketed = padded.micro.bucketed(b)
        rows, wb = bucketed.input_ids.shape
        assert wb % 8 == 0 and width <= wb < width + 8
        if budget is not None:
            assert rows * wb <= max(budget, wb)  # every micro-batch (padding included) within the token budget
            assert rows == max(1, budget // wb)  # and of the one row count its width has: one shape per width
        else:
            assert rows == 3
        n, t = b.input_ids.shape[0], b.response_mask.shape[1]
        assert torch.equal(bucketed.input_ids[:n, :width], b.input_ids)
        assert torch.equal(bucketed.response_mask[:n, :t], b.response_mask)
        assert not bucketed.response_mask[:, t:].any() and not bucketed.response_mask[n:].any()
        assert not bucketed.attention_mask[:n, width:].any()  # padding columns are outside the attention mask
        assert bucketed.attention_mask[n:].all()  # padding rows attend to themselves: no fully masked row

    ref = plain.compute_logprobs(batch, 1.0)
    got = padded.compute_logprobs(batch, 1.0)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=0, atol=3e-2)  # bf16 forwards of other shapes: rounding only
    assert not got[mask == 0].any()

    adv = torch.randn(len(mask), generator=torch.Generator().manual_seed(2))
    m_plain = plain.policy_step(PolicyStep(batch, adv, RecomputedOld(ref, None, mask), GRPOConfig(), 1.0))
    m_pad = padded.policy_step(PolicyStep(batch, adv, RecomputedOld(ref, None, mask), GRPOConfig(), 1.0))
    assert m_pad["loss"] == pytest.approx(m_plain["loss"], rel=2e-2, abs=2e-3)
    assert m_pad["grad_norm"] == pytest.approx(m_plain["grad_norm"], rel=5e-2)
    assert m_pad["tokens_valid"] == m_plain["tokens_valid"]
    assert m_pad["tokens_computed"] > m_plain["tokens_computed"]  # the padding is counted as computed


def test_layer_dispatch_is_the_layer_itself_when_not_replaying(tiny_models: dict[str, Path]) -> None:
    """Installing the graphs' dispatch changes nothing outside a replay (on the CPU every forward is eager), and
    the trainer's forwards reach it with what a capture takes: no KV cache, the position embeddings, the mask."""
    batch, _ = _batch()
    trainer = TorchTrainer(
        tiny_models["tiny"],
        TrainerOptions(optim=OptimConfig(micro_batch_size=4, lr=2e-5, warmup_steps=0)),
        device="cpu",
    )
    layers = trainer.model.model.layers
    with torch.no_grad():
        ref = trainer.compute_logprobs(batch, 1.0)
        graphs = LayerGraphs(layers, max_shapes=1, prepare=lambda: None)
        assert all("forward" in vars(layer) for layer in layers)
        asked = []
        select = graphs._select
        graphs._select = lambda i, h, mask, pe: (
            asked.append((i, h.shape, mask is not None, len(pe))) or select(i, h, mask, pe)
        )
        with graphs.active():
            got = trainer.compute_logprobs(batch, 1.0)
        trainer.compute_logprobs(batch, 1.0)  # not active: never asked
    assert torch.equal(got, ref)
    assert [a[0] for a in asked] == list(range(len(layers))) * 2  # 7 rows, 4 a micro-batch: two forwards
    assert all(a[2] and a[3] == 2 for a in asked)  # left-padded prompts: a mask; (cos, sin)
    assert graphs.captures == 0 and graphs.replays == 0 and not graphs.enabled
    with pytest.raises(ValueError, match=r"optim\.cuda_graph_shapes must be >= 1"):
        LayerGraphs(trainer.model.model.layers, max_shapes=0, prepare=lambda: None)
