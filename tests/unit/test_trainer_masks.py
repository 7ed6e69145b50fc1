"""The trainer hands HF's model its attention mask in a form whose preparation reads nothing back from the device
(``fp8rl.train.model_inputs``): the logits must be exactly those of the plain call with the 2-D padding mask and
position ids, padded or not, and nothing inside HF's forward may read a tensor's value (on a GPU each such read waits
for all queued work).  That no synchronisation is left is counted on a GPU: ``tests/gpu/test_trainer_syncs_cuda.py``."""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import torch

from fp8rl.config import OptimConfig
from fp8rl.train.batches import SequenceBatch, build_batch, micro_batch_weight, policy_batch_totals
from fp8rl.train.model_inputs import causal_padding_mask, prepares_masks
from fp8rl.train.trainer import TorchTrainer, TrainerOptions

READS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__")


def _batches() -> dict[str, SequenceBatch]:
    g = torch.Generator().manual_seed(0)
    return {
        "padded": build_batch([[5, 6, 7], [8, 9]], torch.randint(3, 100, (2, 4), generator=g),
                              torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1]]), pad_id=0),
        "unpadded": build_batch([[5, 6], [8, 9]], torch.randint(3, 100, (2, 3), generator=g), torch.ones(2, 3), pad_id=0),
    }  # fmt: skip


def _hf(trainer: TorchTrainer, b: SequenceBatch) -> torch.Tensor:
    out: torch.Tensor = trainer.model(
        input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids, use_cache=False
    ).logits
    return out


def _reads_inside_hf(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every value read made from inside transformers' code while the patch lasts."""
    reads: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def recording(self: torch.Tensor, *a: object, _original=original, _name=name, **k: object) -> object:  # type: ignore[no-untyped-def]
            if any(f"{os.sep}transformers{os.sep}" in f.filename for f in traceback.extract_stack()[:-1]):
                reads.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, recording)
    return reads


@pytest.mark.parametrize("kind", ["padded", "unpadded"])
def test_the_trainer_forward_equals_hf_and_reads_nothing(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    trainer = TorchTrainer(
        tiny_models["small"], TrainerOptions(precision="bf16", optim=OptimConfig(lr=2e-5, warmup_steps=0)), device="cpu"
    )
    assert trainer._masks
    batch = _batches()[kind]
    mask, positions = trainer._model_inputs(batch)
    assert (mask is None and positions is None) == (kind == "unpadded")
    reads = _reads_inside_hf(monkeypatch)
    with torch.no_grad():
        want = _hf(trainer, batch)
        plain = len(reads)
        got = trainer._logits(batch.input_ids, mask, positions)
    assert plain > 0  # the instrument sees HF's own reads (padding? packed sequences?)
    assert len(reads) == plain, reads[plain:]
    assert torch.equal(got, want)
    assert trainer.model.config._attn_implementation == "sdpa"  # the forward's own name is gone again


def test_gradients_through_checkpointed_layers_equal_hf(tiny_models: dict[str, Path]) -> None:
    """The backward recomputes checkpointed layers under ``sdpa`` again: the same function on the same arguments."""
    grads = []
    for ours in (False, True):
        trainer = TorchTrainer(
            tiny_models["small"],
            TrainerOptions(precision="bf16", optim=OptimConfig(activation_checkpointing=True, lr=2e-5, warmup_steps=0)),
        )
        for b in _batches().values():
            logits = trainer._logits(b.input_ids, *trainer._model_inputs(b)) if ours else _hf(trainer, b)
            logits.float().square().mean().backward()
        grads.append([p.grad.clone() for p in trainer.model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_other_attention_and_sliding_windows_take_hfs_path(tiny_models: dict[str, Path]) -> None:
    trainer = TorchTrainer(
        tiny_models["small"], TrainerOptions(precision="bf16", optim=OptimConfig(lr=2e-5, warmup_steps=0)), device="cpu"
    )
    config = trainer.model.config
    config._attn_implementation = "eager"
    assert not prepares_masks(config)
    config._attn_implementation = "sdpa"
    config.layer_types = ["full_attention", "sliding_attention"]
    assert not prepares_masks(config)
    config.layer_types = ["full_attention"] * 2
    assert prepares_masks(config)


def test_causal_padding_mask_is_causal_and_hides_padded_keys() -> None:
    m = causal_padding_mask(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert m.shape == (2, 1, 3, 3) and m.dtype == torch.bool
    assert m[1, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert m[0, 0].tolist() == [[False, False, False], [False, True, False], [False, True, True]]


def test_a_backend_sets_the_context_of_its_checkpointed_layers_recompute(tiny_models: dict[str, Path]) -> None:
    """``TorchTrainer._checkpoint_contexts`` is what HF's checkpointing calls for every checkpointed layer: a backend
    overriding it (the TE trainer enters its FP8 autocast for the recompute, which runs in the backward) has its
    recompute context entered once per layer and forward, during the backward, and its first-forward one before."""
    events: list[str] = []

    @contextmanager
    def marked(inner: AbstractContextManager[None], name: str) -> Iterator[None]:
        events.append(name)
        with inner:
            yield

    class Marked(TorchTrainer):
        def _checkpoint_contexts(self) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
            first, recompute = super()._checkpoint_contexts()
            return marked(first, "first"), marked(recompute, "recompute")

    trainer = Marked(
        tiny_models["small"],
        TrainerOptions(precision="fp8", optim=OptimConfig(activation_checkpointing=True, lr=2e-5, warmup_steps=0)),
    )
    layers = trainer.model.config.num_hidden_layers
    b = next(iter(_batches().values()))
    logits = trainer._logits(b.input_ids, *trainer._model_inputs(b))
    assert events == ["first"] * layers
    logits.float().square().mean().backward()
    assert events == ["first"] * layers + ["recompute"] * layers


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_weights_sum_to_one_over_the_batch(loss_agg: str) -> None:
    """Any split of a batch into micro-batches weighs their losses so they add up to the whole batch's: token-mean
    by valid tokens, seq-mean-token-mean by sequences with a valid token (an all-masked row counts in neither)."""
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
    totals = policy_batch_totals(mask)
    assert totals == (10.0, 4.0)
    for split in ([slice(0, 5)], [slice(0, 2), slice(2, 5)], [slice(i, i + 1) for i in range(5)]):
        weights = [micro_batch_weight(mask[s], loss_agg, totals) for s in split]
        assert sum(weights) == pytest.approx(1.0)
    expected = 3 / 10 if loss_agg == "token-mean" else 1 / 4
    assert micro_batch_weight(mask[:2], loss_agg, totals) == pytest.approx(expected)
