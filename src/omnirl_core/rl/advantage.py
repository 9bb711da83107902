"""Group-relative advantages (GRPO family)."""

from __future__ import annotations

from typing import Any

import torch


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


def assign_group_advantages(samples: list[Any], *, global_std: bool, clip: float | None) -> torch.Tensor:
    """``group_advantages`` of the samples' rewards, grouped by ``request.group``, written to each
    ``sample.advantage``; returns them (N,)."""
    rewards = torch.tensor([s.reward for s in samples])
    groups = torch.tensor([s.request.group for s in samples])
    adv = group_advantages(rewards, groups, global_std=global_std, clip=clip)
    for sample, a in zip(samples, adv.tolist()):
        sample.advantage = a
    return adv
