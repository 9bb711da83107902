"""Reward dispatch: several rewards combined as a weighted sum, each required or optional.

A failing optional reward is logged and reported (``reward/<name>/failed``); it is left out of the sum
for that batch, never silently scored 0. A failing required reward fails the step.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from omnirl_core.errors import OmnirlError
from omnirl_core.interfaces import Sample

log = logging.getLogger("omnirl.rewards")


@dataclass
class RewardFn:
    name: str
    fn: Callable[[Sequence[Any], Sequence[str]], list[float]]
    weight: float = 1.0
    required: bool = True


class RewardError(OmnirlError):
    pass


class RewardSet:
    def __init__(self, rewards: list[RewardFn]):
        if not rewards:
            raise ValueError("at least one reward is needed")
        self.rewards = rewards
        self.time_s = 0.0

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Fill ``sample.rewards`` and ``sample.reward`` in place; returns failure flags as metrics."""
        if not samples:
            return {}
        start = time.perf_counter()
        outputs = [s.output for s in samples]
        prompts = [s.prompt for s in samples]
        failed: dict[str, float] = {}
        for reward in self.rewards:
            try:
                values = list(reward.fn(outputs, prompts))
                if len(values) != len(samples):
                    raise ValueError(f"returned {len(values)} scores for {len(samples)} samples")
                bad = [v for v in values if not math.isfinite(float(v))]
                if bad:
                    raise ValueError(f"returned non-finite scores {bad[:3]}")
            except Exception as exc:
                if reward.required:
                    raise RewardError(
                        f"Required reward '{reward.name}' failed: {type(exc).__name__}: {exc}",
                        hint=f"Fix the reward, or mark it optional (rewards[].required=false).",
                    ) from exc
                log.warning("optional reward %s failed on %d samples: %s", reward.name, len(samples), exc)
                failed[f"reward/{reward.name}/failed"] = 1.0
                continue
            for sample, value in zip(samples, values):
                sample.rewards[reward.name] = float(value)
        for sample in samples:
            sample.reward = sum(
                r.weight * sample.rewards[r.name] for r in self.rewards if r.name in sample.rewards
            )
        self.time_s += time.perf_counter() - start
        return failed
