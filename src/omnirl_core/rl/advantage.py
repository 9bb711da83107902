"""Group-relative advantages (GRPO family)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from omnirl_core.config import RewardEntry
    from omnirl_core.contracts import Sample


def group_advantages(
    rewards: torch.Tensor,
    groups: torch.Tensor,
    *,
    global_std: bool = True,
    eps: float = 1e-4,
    clip: float | None = 5.0,
) -> torch.Tensor:
    """A_i = (r_i - mean of i's group) / (std + eps); std per group or over the whole batch; clipped.

    ``rewards`` and ``groups`` are (N,); the std is the population std (unbiased=False), as in the references.
    """
    rewards = rewards.double()
    adv = torch.empty_like(rewards)
    group_std = torch.empty_like(rewards)
    for g in torch.unique(groups):
        idx = groups == g
        adv[idx] = rewards[idx] - rewards[idx].mean()
        group_std[idx] = rewards[idx].std(unbiased=False)
    std = rewards.std(unbiased=False) if global_std else group_std
    adv = adv / (std + eps)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.float()


def assign_group_advantages(samples: list[Sample], *, global_std: bool, clip: float | None,
                            rewards: Sequence[RewardEntry] = ()) -> torch.Tensor:
    """``group_advantages`` of the samples' rewards, grouped by ``request.group``, written to each
    ``sample.advantage``; returns them (N,).

    With ``rewards`` (the run's reward entries) of which some have ``advantage: own``:
    A_i = GA(sum_{k joint} w_k r_ik) + sum_{k own} w_k GA(r_k)_i, GA the group advantage, clipped after the
    sum (DanceGRPO / GDPO); a reward dropped for a group adds nothing to that group's advantages."""
    groups = torch.tensor([s.request.group for s in samples])
    own = [r for r in rewards if r.advantage == "own"]
    if not own:
        adv = group_advantages(torch.tensor([s.reward for s in samples]), groups, global_std=global_std, clip=clip)
    else:
        adv = torch.zeros(len(samples))
        joint = [r for r in rewards if r not in own]
        if joint:
            summed = torch.tensor([sum(r.weight * s.rewards[r.name] for r in joint if r.name in s.rewards)
                                   for s in samples])
            adv += group_advantages(summed, groups, global_std=global_std, clip=None)
        for entry in own:
            have = torch.tensor([entry.name in s.rewards for s in samples])
            if not bool(have.any()):
                continue
            values = torch.tensor([s.rewards.get(entry.name, 0.0) for s in samples])
            adv[have] += entry.weight * group_advantages(values[have], groups[have], global_std=global_std, clip=None)
        adv = adv.clamp(-clip, clip) if clip is not None else adv
    for sample, a in zip(samples, adv.tolist()):
        sample.advantage = a
    return adv
