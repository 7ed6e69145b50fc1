"""The trainer hands HF's model its attention mask in a form whose preparation reads nothing back from the device
(``TorchTrainer._model_inputs``, ``causal_padding_mask``): the logits must be exactly those of the plain call with
the 2-D padding mask and position ids, padded or not.  (That no synchronisation is left is counted on a GPU:
``tests/gpu/test_trainer_syncs_cuda.py``.)"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch

from fp8rl.train.batches import build_batch
from fp8rl.train.trainer import TorchTrainer, TrainerOptions, causal_padding_mask


def test_the_trainer_forward_equals_hf_with_the_2d_mask(tiny_models: dict[str, Path]) -> None:
    trainer = TorchTrainer(tiny_models["small"], TrainerOptions(precision="bf16"), device="cpu")
    g = torch.Generator().manual_seed(0)
    padded = build_batch([[5, 6, 7], [8, 9]], torch.randint(3, 100, (2, 4), generator=g),
                         torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1]]), pad_id=0)  # fmt: skip
    plain = build_batch([[5, 6], [8, 9]], torch.randint(3, 100, (2, 3), generator=g), torch.ones(2, 3), pad_id=0)
    for batch, none in ((padded, False), (plain, True)):
        mask, positions = trainer._model_inputs(batch)
        assert (mask is None and positions is None) == none
        with torch.no_grad():
            got = trainer._logits(batch.input_ids, mask, positions)
            want = trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 position_ids=batch.position_ids, use_cache=False).logits  # fmt: skip
        assert torch.equal(got, want)


def test_causal_padding_mask_is_causal_and_hides_padded_keys() -> None:
    m = causal_padding_mask(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert m.shape == (2, 1, 3, 3) and m.dtype == torch.bool
    assert m[1, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert m[0, 0].tolist() == [[False, False, False], [False, True, False], [False, True, True]]


def test_hf_reads_no_tensor_value_during_the_trainer_forward(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU each value HF's forward reads back (``bool(tensor)`` in its mask preparation: is there padding?) waits
    for the queued work: with the plain 2-D mask HF reads two per forward, with the trainer's inputs none."""
    trainer = TorchTrainer(tiny_models["small"], TrainerOptions(precision="bf16"), device="cpu")
    batch = build_batch([[5, 6, 7], [8, 9]], torch.arange(3, 11).reshape(2, 4), torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1]]),
                        pad_id=0)  # fmt: skip
    reads: list[str] = []
    for name in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)

        def recording(self: torch.Tensor, *a: object, _original=original, _name=name, **k: object) -> object:  # type: ignore[no-untyped-def]
            frames = [f.filename for f in traceback.extract_stack()[:-1]]
            if any(f"{os.sep}transformers{os.sep}" in f for f in frames):
                reads.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, recording)
    with torch.no_grad():
        trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                      use_cache=False)  # fmt: skip
        plain = len(reads)
        trainer._logits(batch.input_ids, *trainer._model_inputs(batch))
    assert plain > 0  # the instrument sees HF's reads
    assert len(reads) == plain, reads[plain:]
