"""A trainer's weights and state: what is synced to the rollout engine, checkpointed and resumed, and saved as an HF
checkpoint -- sharded (FSDP2: gathered one parameter at a time, a collective on every rank) or not.

``TrainerWeights`` is the part of ``fp8rl.train.trainer.TorchTrainer`` that reads and writes them; it uses the
trainer's ``model``, ``optimizer``, ``scheduler``, ``step_count``, ``sharded``, ``_reshard_held`` and
``_weights_changed``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from fp8rl.atomic import atomic_directory
from fp8rl.models.tiny import pin_tokenizer_class
from fp8rl.models.tokenizer import is_char_tokenizer


class TrainerWeights:
    """Weights and state of a trainer (module docstring)."""

    model: Any  # the HF model (FSDP2-wrapped when sharded)
    optimizer: Any
    scheduler: Any
    step_count: int
    sharded: bool

    def _reshard_held(self) -> None: ...

    def _weights_changed(self) -> None: ...

    def hf_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """The model's (bf16) weights under their HF names: what is synced and checkpointed.

        Sharded, the full weights are gathered one parameter at a time (a collective: every rank calls it)
        and rounded to bf16 on this rank's device: the rollout payload and the sync requantize them on the
        GPU as unsharded.  ``keep=False`` (the ranks that only join the gathers) drops each one at once and
        returns ``{}``, so that rank never holds the whole model."""
        if not self.sharded:
            return {name: p.detach() for name, p in self.model.named_parameters()} if keep else {}
        return {name: w for name, w in self._gathered() if keep}

    def _gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter's full bf16 tensor on this device, one at a time (sharded: a collective each)."""
        from torch.distributed.tensor import DTensor

        self._reshard_held()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
                yield name, full.to(torch.bfloat16)

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: fp32 masters, AdamW state, schedule position, step count.

        The same layout sharded or not (full tensors; sharded, gathered by every rank and kept by rank 0
        alone: the others get empty masters and optimizer state), so either resumes the other."""
        masters, optim_state = self.optimizer.full_state()
        return {
            "masters": masters,
            "optimizer": optim_state,
            "scheduler": self.scheduler.state_dict(),
            "step_count": self.step_count,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_full_state(state["masters"], state["optimizer"])
        self._weights_changed()
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = int(state["step_count"])

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save an HF checkpoint (bf16); FP8 linears are plain ``nn.Linear`` subclasses with the same names.

        Sharded: every rank gathers; only rank 0 writes."""
        if not self.sharded:
            self.model.save_pretrained(path)
            return
        import torch.distributed as dist
        from safetensors.torch import save_file

        lead = dist.get_rank() == 0  # gathered one parameter at a time; only rank 0 keeps a (CPU) copy
        weights = {k: v.cpu().contiguous() for k, v in self._gathered() if lead}
        if lead:  # the files save_pretrained writes for one shard; tied weights are named once
            os.makedirs(path, exist_ok=True)
            self.model.config.save_pretrained(path)
            if self.model.generation_config is not None:
                self.model.generation_config.save_pretrained(path)
            save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})

    def save_checkpoint(
        self, dst: str | os.PathLike[str], tokenizer: PreTrainedTokenizerBase, overwrite: bool = True
    ) -> None:
        """The policy and its tokenizer as one loadable HF directory, written atomically."""
        if self.sharded:
            import torch.distributed as dist

            if dist.get_rank() != 0:
                self.save(dst)  # its part of the gathers; rank 0 writes
                return
        with atomic_directory(dst, overwrite=overwrite) as tmp:
            self.save(tmp)
            tokenizer.save_pretrained(tmp)
            if is_char_tokenizer(tokenizer):  # a real model's tokenizer config is saved as it is
                pin_tokenizer_class(tmp)
