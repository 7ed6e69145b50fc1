"""Group-relative advantages from scalar rewards (GRPO, Dr. GRPO, RLOO).

Each prompt is sampled ``group_size`` times; the group's other samples are the
baseline, so no value network is needed.  One advantage per sequence; the loss
broadcasts it to every response token.
"""

from __future__ import annotations

import torch
from torch import Tensor


def grpo_advantages(
    rewards: Tensor,
    group_size: int,
    std_normalize: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """Advantages of ``N = num_prompts * group_size`` samples, each against its own group.

    Shapes: rewards [N], laid out as consecutive groups (samples ``g * group_size``
    to ``(g + 1) * group_size - 1`` share a prompt); returns [N] in float32 (float64
    if the rewards are float64), detached.  With ``r_i`` the rewards of one group of
    size G, ``mean = (1/G) sum_j r_j``, and ``std`` its Bessel-corrected standard
    deviation ``sqrt(sum_j (r_j - mean)^2 / (G - 1))``:

        default              A_i = (r_i - mean) / (std + eps)
                             GRPO outcome supervision (Shao et al. 2024,
                             DeepSeekMath §4.1.2); the paper does not say which
                             std, this is the unbiased one veRL and TRL compute
        std_normalize=False  A_i = r_i - mean
                             Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like
                             Training"): the std division up-weights prompts whose
                             rewards barely vary (too easy or too hard)
        leave_one_out        A_i = r_i - (1/(G-1)) sum_{j != i} r_j = G/(G-1) (r_i - mean)
                             RLOO (Ahmadian et al. 2024); with std_normalize it is
                             then divided by (std + eps) of the whole group as above

    A group whose rewards are all equal carries no learning signal and gets
    exactly 0 (not the eps-amplified rounding residue of ``r - mean``).  A group of
    one (``group_size=1``, no leave-one-out) also gets 0.

    Raises ValueError for a non-1-D ``rewards``, ``group_size < 1``, ``N`` not a
    multiple of ``group_size``, or ``leave_one_out`` with ``group_size < 2``.
    """
    _check_groups(rewards, group_size, leave_one_out)
    r = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32)).view(-1, group_size)
    if leave_one_out:
        baseline = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    else:
        baseline = r.mean(dim=1, keepdim=True)
    adv = r - baseline
    if std_normalize:
        std = r.std(dim=1, keepdim=True, correction=1 if group_size > 1 else 0)
        adv = adv / (std + eps)
    constant_group = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant_group, torch.zeros_like(adv), adv).reshape(-1)


def _check_groups(rewards: Tensor, group_size: int, leave_one_out: bool) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {list(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size}: N must be num_prompts * group_size"
        )
    if leave_one_out and group_size < 2:
        raise ValueError(f"leave_one_out needs group_size >= 2 (a baseline from the others), got {group_size}")
