"""A policy batch as the trainer takes it (``SequenceBatch``, ``build_batch``) and how the trainer cuts it into
micro-batches (``MicroBatcher``): by rows or by padded tokens, padded to CUDA-graph shapes where graphs replay the
layers, and with empty micro-batches where sharded ranks must run as many forwards as the busiest."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceBatch:
    """Prompts (left-padded) followed by responses: ``input_ids [N, P+T]``, ``attention_mask [N, P+T]``,
    ``position_ids [N, P+T]``; the response tokens are ``input_ids[:, P:]`` with ``response_mask [N, T]``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    prompt_width: int

    def slice(self, s: slice) -> SequenceBatch:
        return SequenceBatch(
            self.input_ids[s], self.attention_mask[s], self.position_ids[s], self.response_mask[s], self.prompt_width
        )

    def extents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: prompt tokens (left of ``prompt_width``) and response columns up to its last valid token."""
        p = self.prompt_width
        prompt = self.attention_mask[:, :p].sum(-1)
        cols = torch.arange(1, self.response_mask.shape[1] + 1)
        response = (self.response_mask.bool() * cols).amax(-1) if self.response_mask.numel() else prompt * 0
        return prompt, response

    def trimmed(self) -> SequenceBatch:
        """The same rows without the columns that are padding in every row (left of the longest prompt, right
        of the longest response; at least one response column): what a micro-batch's forward computes."""
        prompt, response = self.extents()
        left = self.prompt_width - int(prompt.max()) if len(prompt) else 0
        right = self.prompt_width + max(int(response.max()) if len(response) else 0, 1)
        cols = slice(left, right)
        return SequenceBatch(
            self.input_ids[:, cols], self.attention_mask[:, cols], self.position_ids[:, cols],
            self.response_mask[:, : right - self.prompt_width], self.prompt_width - left,
        )  # fmt: skip


def build_batch(
    prompt_ids: list[list[int]], response_ids: torch.Tensor, response_mask: torch.Tensor, pad_id: int
) -> SequenceBatch:
    n, t = response_ids.shape
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((n, width + t), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width + t), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p) : width] = torch.tensor(p)
        attn[i, width - len(p) : width] = 1
    ids[:, width:] = response_ids.cpu()
    attn[:, width:] = response_mask.cpu().long()
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    return SequenceBatch(ids, attn, positions, response_mask.cpu().float(), width)


def policy_batch_totals(loss_mask: torch.Tensor) -> tuple[float, float]:
    """(valid tokens, valid sequences) of a policy batch: the denominators of its loss aggregation."""
    return float(loss_mask.sum().clamp(min=1)), float((loss_mask.sum(-1) > 0).sum().clamp(min=1))


def micro_batch_weight(mb_mask: torch.Tensor, loss_agg: str, totals: tuple[float, float]) -> float:
    """The weight of a micro-batch's loss in the batch's: its valid tokens over the batch's (``token-mean``) or its
    valid sequences over the batch's (``seq-mean-token-mean``, each sequence's tokens averaged within the loss),
    so the weighted micro-batch losses sum to the loss of the whole batch (``totals``: ``policy_batch_totals``)."""
    if loss_agg == "token-mean":
        return float(mb_mask.sum()) / totals[0]
    return float((mb_mask.sum(-1) > 0).sum()) / totals[1]


@dataclass(frozen=True)
class MicroBatcher:
    """The trainer's micro-batching (``TrainerOptions``' ``micro_batch_size`` / ``micro_batch_tokens``)."""

    micro_batch_size: int
    micro_batch_tokens: int | None
    width_step: int | None  # with CUDA graphs: micro-batch widths in steps of this many columns
    pad_token_id: int
    sharded: bool
    device: torch.device

    def width(self, width: int) -> int:
        """A micro-batch's padded width: with CUDA graphs rounded up to ``cuda_graph_width`` columns."""
        step = self.width_step
        return width if step is None else -(-width // step) * step

    def rows(self, width: int) -> int:
        """With CUDA graphs, the rows of every micro-batch of this padded width."""
        budget = self.micro_batch_tokens
        return max(1, budget // width) if budget is not None else self.micro_batch_size

    def bucketed(self, b: SequenceBatch) -> SequenceBatch:
        """``b`` (trimmed) padded to its CUDA-graph shape (without CUDA graphs: ``b``): columns of padding on the
        right (outside the attention mask and the loss), rows of padding below (attending to themselves, outside
        the loss)."""
        if self.width_step is None:
            return b
        n, width = b.input_ids.shape
        wb = self.width(width)
        rows = max(n, self.rows(wb))
        if (rows, wb) == (n, width):
            return b
        ids = torch.full((rows, wb), self.pad_token_id, dtype=b.input_ids.dtype)
        attn = torch.ones((rows, wb), dtype=b.attention_mask.dtype)
        pos = torch.arange(wb, dtype=b.position_ids.dtype).repeat(rows, 1)
        resp = torch.zeros((rows, wb - b.prompt_width), dtype=b.response_mask.dtype)
        ids[:n, :width] = b.input_ids
        attn[:n, width:] = 0
        attn[:n, :width] = b.attention_mask
        pos[:n, :width] = b.position_ids
        pos[:n, width:] = b.position_ids[:, width - 1 :]  # the last position, as right padding has
        resp[:n, : b.response_mask.shape[1]] = b.response_mask
        return SequenceBatch(ids, attn, pos, resp, b.prompt_width)

    def slices(self, batch: SequenceBatch) -> list[slice]:
        """This rank's micro-batches: ``micro_batch_size`` rows, or with ``micro_batch_tokens`` as many consecutive
        rows as fit that many padded tokens (at least one row).  Sharded, every rank runs as many (the
        collectives pair up), padding with empty ones that run a one-row forward (and backward) that counts for
        nothing."""
        n = batch.input_ids.shape[0]
        budget = self.micro_batch_tokens
        if budget is None:
            slices = [slice(s, s + self.micro_batch_size) for s in range(0, n, self.micro_batch_size)]
        else:
            prompt, response = batch.extents()
            slices, start, width_p, width_r = [], 0, 0, 0
            for i in range(n):
                wp, wr = max(width_p, int(prompt[i])), max(width_r, int(response[i]), 1)
                if i > start and (i - start + 1) * self.width(wp + wr) > budget:
                    slices.append(slice(start, i))
                    start, wp, wr = i, int(prompt[i]), max(int(response[i]), 1)
                width_p, width_r = wp, wr
            if n:
                slices.append(slice(start, n))
        count = len(slices)
        if self.sharded:
            import torch.distributed as dist

            most = torch.tensor([count], device=self.device if self.device.type == "cuda" else "cpu")
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            slices += [slice(0, 0)] * (int(most.item()) - count)
        return slices

    def padding_batch(self, like: SequenceBatch) -> SequenceBatch:
        """One row of padding with one response token: a forward that every rank can run."""
        w = like.prompt_width
        ids = torch.full((1, w + 1), self.pad_token_id, dtype=torch.long)
        attn = torch.ones_like(ids)
        return SequenceBatch(ids, attn, (attn.cumsum(-1) - 1), torch.zeros(1, 1), w)
