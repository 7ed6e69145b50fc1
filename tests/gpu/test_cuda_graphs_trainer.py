"""``optim.cuda_graphs`` on a GPU: the decoder layers captured and replayed by the torch trainer.

The graphed trainer against the eager one padding its micro-batches to the same shapes (``MicroBatcher.width_step``),
from the same weights: logprobs, losses, gradient norms and the weights after several policy steps, for BF16
and FP8 (the tiny model has whole 128-tiles, so FP8 takes the fused Hopper path whose cached weight operands
the graphs read and the optimizer step requantizes in place); each shape is captured once, replayed after,
and the least recently used shape is dropped when a new one needs room.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
pytest.importorskip("pydantic")  # the trainer reads fp8rl.config (the bare GPU image has no pydantic)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

TOL = {"rtol": 2e-3, "atol": 2e-3}


def _trainers(model: Path, precision: str, **kw):
    from fp8rl.config import OptimConfig
    from fp8rl.train.trainer import TorchTrainer, TrainerOptions

    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89+")
    base = {"lr": 1e-2, "warmup_steps": 0, "micro_batch_size": 4, **kw}
    eager = TorchTrainer(model, TrainerOptions(precision=precision, optim=OptimConfig(**base)), device="cuda")
    eager.micro = replace(eager.micro, width_step=16)  # the graphed trainer's padding, without its graphs
    graphed_optim = OptimConfig(**base, cuda_graphs=True, cuda_graph_width=16)
    graphed = TorchTrainer(model, TrainerOptions(precision=precision, optim=graphed_optim), device="cuda")
    return eager, graphed


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_graphed_trainer_matches_the_eager_one_on_the_same_shapes(tiny_models: dict[str, Path], precision: str):
    from sharded_trainer_worker import fixed_batch

    from fp8rl.config import GRPOConfig
    from fp8rl.train.fp8_linear import FP8TrainLinear

    batch, adv, old, mask = fixed_batch()
    eager, graphed = _trainers(tiny_models["small"], precision)
    if precision == "fp8":
        assert any(isinstance(m, FP8TrainLinear) for m in graphed.model.modules())
    previous = None
    for _ in range(4):
        lp_e, lp_g = eager.compute_logprobs(batch, 1.0), graphed.compute_logprobs(batch, 1.0)
        torch.testing.assert_close(lp_g, lp_e, **TOL)
        if previous is not None:  # the replays read the updated weights, not the captured ones
            assert (lp_g - previous).abs().max() > 20 * TOL["atol"]
        previous = lp_g
        m_e = eager.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0))
        m_g = graphed.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0))
        assert m_g["loss"] == pytest.approx(m_e["loss"], rel=2e-3, abs=1e-5)
        assert m_g["grad_norm"] == pytest.approx(m_e["grad_norm"], rel=2e-3)
        assert m_g["tokens_computed"] == m_e["tokens_computed"]
    weights_e, weights_g = eager.hf_state_dict(), graphed.hf_state_dict()
    for name, w in weights_e.items():  # AdamW's sign-like updates can flip on rounding-sized gradients: a fraction
        off = (weights_g[name].float() - w.float()).abs() > 1e-3
        assert off.float().mean() < 1e-3, (name, int(off.sum()))
    graphs = graphed.graphs
    assert graphs is not None
    assert graphs.captures == 1 and len(graphs.shapes) == 1  # 10 rows, 4 a micro-batch, widths <= 16: one shape
    # step 1: the 3 logprob micro-batches eager (first sighting, then no gradients to capture with), the
    # first policy micro-batch captures (and replays); from there on each of the 3 + 2 forwards a step replays
    assert graphs.eager == 3 and graphs.replays == 2 + 3 * 5
    assert m_g["cuda_graph_captures"] == 1.0


def test_least_recently_used_shape_is_dropped(tiny_models: dict[str, Path]) -> None:
    from sharded_trainer_worker import fixed_batch

    from fp8rl.config import GRPOConfig
    from fp8rl.train.trainer import build_batch

    batch, adv, old, mask = fixed_batch()
    longer = build_batch(
        [row[row > 0].tolist() for row in batch.input_ids[:, : batch.prompt_width]],
        torch.cat([batch.input_ids[:, batch.prompt_width :]] * 3, dim=1),
        torch.cat([mask] * 3, dim=1),
        pad_id=0,
    )  # the same prompts with 18-token responses: micro-batches 32 columns wide instead of 16
    old_long, mask_long = torch.cat([old] * 3, dim=1), torch.cat([mask] * 3, dim=1)
    eager, graphed = _trainers(tiny_models["small"], "fp8", cuda_graph_shapes=1)
    for b, o, m in [(batch, old, mask), (longer, old_long, mask_long)] * 2:
        m_e = eager.policy_step(PolicyStep(b, adv, RecomputedOld(o, None, m), GRPOConfig(), 1.0))
        m_g = graphed.policy_step(PolicyStep(b, adv, RecomputedOld(o, None, m), GRPOConfig(), 1.0))
        assert m_g["loss"] == pytest.approx(m_e["loss"], rel=2e-3, abs=1e-5)
    graphs = graphed.graphs
    assert graphs is not None
    assert graphs.captures == 4  # each shape captured again after the other displaced it
    assert len(graphs.shapes) == 1 and graphs.shapes[0][0][1] == 32  # the last one used: [4, 32, hidden]
