"""What the trainer hands HF's model for a micro-batch, so that the forward never reads a value back from the GPU.

A host read of a device value waits for everything queued before it; once per micro-batch, the GPU then idles while the
host prepares and launches the next one.  HF's own mask preparation makes such reads under SDPA
(``transformers.masking_utils``: with a 2-D padding mask it asks "is any token padded?", without one it asks the position
ids "are sequences packed?").  So the trainer prepares the mask itself (``TorchTrainer._model_inputs`` and ``_logits``):

- a padded micro-batch gets the 4-D boolean mask HF builds from the padding mask under SDPA for torch >= 2.5
  (``causal_padding_mask``: key <= query and the key a token), which HF passes through untouched;
- an unpadded one (decided on the host) gets no mask and no position ids, and SDPA runs with ``is_causal`` (the flash
  kernel), as HF itself picks for it.  To keep HF from inspecting the position ids it makes, the forward runs the same
  SDPA function under a name of fp8rl's own (``NO_MASK_SDPA``) for which HF keeps no mask function: HF then prepares
  no mask at all.  The name is set on the model's config for the forward only (``no_mask_sdpa``); a recompute of a
  checkpointed layer in the backward, under ``sdpa`` again, gets the same arguments and calls the same function.

Models with sliding-window layers, and attention implementations other than SDPA, take HF's path unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NO_MASK_SDPA = "fp8rl_sdpa"
AttentionInterface.register(NO_MASK_SDPA, sdpa_attention_forward)


def prepares_masks(config: Any) -> bool:
    """Whether the trainer prepares this model's masks: SDPA attention, every layer full attention."""
    layer_types = getattr(config, "layer_types", None) or []
    return (
        getattr(config, "_attn_implementation", None) == "sdpa"
        and not getattr(config, "use_sliding_window", False)
        and all(t == "full_attention" for t in layer_types)
    )


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[n, L]`` padding mask (1: a token) -> the ``[n, 1, L, L]`` boolean mask (True: attend) HF's SDPA path builds
    from it for torch >= 2.5 (``transformers.masking_utils.sdpa_mask``), made on the mask's device without a read."""
    length = attention_mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril_()
    return causal[None, None] & attention_mask.bool()[:, None, None, :]


def unpadded(attention_mask: torch.Tensor, position_ids: torch.Tensor) -> bool:
    """Whether a host micro-batch has no padding and the plain positions 0 .. L-1 in every row."""
    n, length = attention_mask.shape
    return bool(attention_mask.all()) and torch.equal(position_ids, torch.arange(length).expand(n, length))


@contextmanager
def no_mask_sdpa(model: torch.nn.Module) -> Iterator[None]:
    """The model's forward under ``NO_MASK_SDPA`` (its config's attention implementation, restored after)."""
    config: Any = model.config
    before = config._attn_implementation
    config._attn_implementation = NO_MASK_SDPA
    try:
        yield
    finally:
        config._attn_implementation = before


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the GPU: a plain ``.to(cuda)`` from pageable memory synchronises
    with the stream, so each micro-batch's inputs would drain the queue the host built ahead; copied through pinned
    memory instead (PyTorch's caching host allocator keeps the buffer until the copy ran)."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
