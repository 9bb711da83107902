"""DanceGRPO over the flow-model contract (Xue et al., 2025).

Rollout: Dance-SDE at every step (constant noise scale eta sqrt(D): stable at s -> 1), the same initial
noise for all G samples of a group, so that the group's rewards differ only through the SDE's choices.
Training: a random subset of the steps per sample (``timestep_fraction``), FlowGRPO's clipped ratio, no KL
by default. Several rewards: each reward is normalised within its group on its own and the advantages are
summed with the rewards' weights (a reward with a large spread does not drown the others). Optionally only
the best k/2 and worst k/2 samples of each group are trained (video, where a sample is expensive).
"""

from __future__ import annotations

import random
from typing import Literal

import torch
from pydantic import Field

from omnirl_core.config import RunConfig
from omnirl_core.contracts import RolloutPlan, Sample
from omnirl_core.errors import ConfigError
from omnirl_core.flow.policy_gradient import FlowPolicyGradient, FlowPolicyGradientOptions, Transition
from omnirl_core.rl.advantage import group_advantages


class DanceGRPOConfig(FlowPolicyGradientOptions):
    noise_level: float = Field(0.3, gt=0, description="eta of the Dance-SDE (0.3 FLUX; 0.7 in MixGRPO's runs).")
    timestep_fraction: float = Field(
        0.6, gt=0, le=1, description="Fraction of the denoising steps trained per sample, drawn at random."
    )
    shared_initial_noise: bool = Field(True, description="All samples of a group start from the same noise.")
    best_worst_k: int | None = Field(
        None, ge=2, description="Train only the k/2 best and k/2 worst samples of each group (None: all)."
    )
    multi_reward: Literal["sum-of-advantages", "weighted-sum"] = Field(
        "sum-of-advantages", description="Several rewards: sum of per-reward group advantages (the paper's), or "
        "one advantage of the weighted reward sum."
    )


def summed_advantages(samples: list[Sample], weights: dict[str, float], global_std: bool,
                      clip: float | None) -> torch.Tensor:
    """sum_k w_k A_k, A_k the group-normalised advantage of reward k alone; then clipped."""
    groups = torch.tensor([s.request.group for s in samples])
    total = torch.zeros(len(samples))
    for name, weight in weights.items():
        if not all(name in s.rewards for s in samples):
            continue  # an optional reward that failed on this batch: left out, as in the reward sum
        values = torch.tensor([s.rewards[name] for s in samples])
        total += weight * group_advantages(values, groups, global_std=global_std, clip=None)
    return total.clamp(-clip, clip) if clip is not None else total


def extremes(samples: list[Sample], k: int) -> list[Sample]:
    """The k/2 highest- and k/2 lowest-reward samples of each group (all of a group smaller than k)."""
    by_group: dict[int, list[Sample]] = {}
    for s in samples:
        by_group.setdefault(s.request.group, []).append(s)
    kept: list[Sample] = []
    for members in by_group.values():
        if len(members) <= k:
            kept += members
            continue
        ranked = sorted(members, key=lambda s: (s.reward, s.request.uid))
        kept += ranked[: k // 2] + ranked[len(ranked) - (k - k // 2):]
    return sorted(kept, key=lambda s: s.request.uid)


class DanceGRPO(FlowPolicyGradient):
    def __init__(self, options: DanceGRPOConfig | None, config: RunConfig):
        super().__init__(options or DanceGRPOConfig(), config)
        o = self.options
        steps = tuple(range(self.num_steps))
        self._plan = RolloutPlan(step_kinds=("dance",) * self.num_steps, train_steps=steps, eta=o.noise_level,
                                 shared_initial_noise=o.shared_initial_noise)
        self.steps_per_sample = max(1, round(o.timestep_fraction * self.num_steps))
        if o.best_worst_k is not None and o.best_worst_k > config.rollout.group_size:
            raise ConfigError(
                f"DanceGRPO best_worst_k = {o.best_worst_k} exceeds the group size {config.rollout.group_size}.",
                hint="Lower algorithm.options.best_worst_k or raise rollout.group_size.",
            )

    def plan(self, step: int) -> RolloutPlan:
        return self._plan

    def assign_advantages(self, samples: list[Sample]) -> dict[str, float]:
        weights = {e.name: e.weight for e in self.config.rewards}
        if self.options.multi_reward == "weighted-sum" or len(weights) < 2:
            return super().assign_advantages(samples)
        adv = summed_advantages(samples, weights, self.options.global_std, self.options.adv_clip)
        for sample, a in zip(samples, adv.tolist()):
            sample.advantage = a
        return {"advantage/abs_mean": float(adv.abs().mean())}

    def trained_steps(self, sample: Sample) -> list[int]:
        """The steps of ``sample`` that are trained: a random subset, drawn from the sample's own seed."""
        candidates = list(sample.request.plan.train_steps)
        picked = random.Random(sample.request.seed).sample(candidates, min(self.steps_per_sample, len(candidates)))
        return sorted(picked)

    def training_units(self, samples: list[Sample]) -> list[Transition]:
        if self.options.best_worst_k is not None:
            samples = extremes(samples, self.options.best_worst_k)
        return [Transition(s, j) for s in samples for j in self.trained_steps(s)]
