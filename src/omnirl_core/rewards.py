"""Reward dispatch: several rewards combined as a weighted sum, each required or optional.

A failing optional reward is logged and reported (``reward/<name>/failed``); it is left out of the sum
for that batch, never silently scored 0. A failing required reward fails the step.
"""

from __future__ import annotations

import logging
import math
import threading
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
        self._lock = threading.Lock()

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Fill ``sample.rewards`` and ``sample.reward`` in place; returns failure flags as metrics."""
        if not samples:
            return {}
        start = time.perf_counter()
        outputs = [s.output for s in samples]
        prompts = [s.prompt for s in samples]
        inputs = [s.request.inputs for s in samples]
        failed: dict[str, float] = {}
        for reward in self.rewards:
            try:
                if getattr(reward.fn, "uses_inputs", False):  # compares against each prompt's record
                    values = list(reward.fn(outputs, prompts, inputs=inputs))
                else:
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
                        hint="Fix the reward, or mark it optional (rewards[].required=false).",
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
        with self._lock:  # reward threads score concurrently
            self.time_s += time.perf_counter() - start
        return failed


@dataclass
class RewardTiming:
    rollout_s: float = 0.0
    """From the start of the rollout to its last finished sample."""
    wait_s: float = 0.0
    """Reward time left after the rollout's end (sync: all of it; async: the tail)."""
    busy_s: float = 0.0
    """Reward compute summed over workers."""

    def metrics(self) -> dict[str, float]:
        return {"time/rollout_s": self.rollout_s, "time/reward_s": self.wait_s, "time/reward_busy_s": self.busy_s}


def merge_failures(results: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for failed in results:
        out.update(failed)
    return out


class RewardStream:
    """Scores a stream of finished samples on a pool of threads.

    ``async``: each sample goes to a reward thread the moment the rollout yields it, so rewards overlap the
    rest of the rollout; ``sync``: the whole batch is scored after the rollout (split over the threads).
    Either way the caller gets every sample back scored: the update waits for the whole batch.
    Threads suffice here: rewards spend their time in native code or I/O that releases the GIL.
    """

    def __init__(self, rewards: RewardSet, workers: int = 2, mode: str = "async"):
        from concurrent.futures import ThreadPoolExecutor

        if mode not in ("async", "sync"):
            raise ValueError(f"reward mode must be 'async' or 'sync', got {mode!r}")
        self.rewards = rewards
        self.workers = workers
        self.mode = mode
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="omnirl-reward")

    def _timed_score(self, samples: list[Sample]) -> tuple[dict[str, float], float]:
        start = time.perf_counter()
        failed = self.rewards.score(samples)
        return failed, time.perf_counter() - start

    def run(self, stream: Any) -> tuple[list[Sample], dict[str, float], RewardTiming]:
        """Drain ``stream`` (an iterator of finished samples); returns (samples, failure flags, timing)."""
        start = time.perf_counter()
        samples: list[Sample] = []
        futures = []
        for sample in stream:
            samples.append(sample)
            if self.mode == "async":
                futures.append(self.pool.submit(self._timed_score, [sample]))
        rollout_end = time.perf_counter()
        if self.mode == "sync":
            size = -(-len(samples) // self.workers) if samples else 1
            futures = [self.pool.submit(self._timed_score, samples[i:i + size])
                       for i in range(0, len(samples), size)]
        results = [f.result() for f in futures]
        timing = RewardTiming(rollout_end - start, time.perf_counter() - rollout_end,
                              sum(busy for _, busy in results))
        return samples, merge_failures([failed for failed, _ in results]), timing

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
