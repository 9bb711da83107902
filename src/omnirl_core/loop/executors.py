"""Executors place the worker groups; the controller drives any of them through the same methods.

``inline``: one colocated worker (actor + rollout, one model: no weight copy) in the controller's
process, rewards on a pool of threads. ``ray``: worker groups as Ray actors (``omnirl_core.loop.ray_executor``,
imported only when selected).

The interface the controller uses:
  setup()                                   build the workers (each builds its own algorithm instance)
  rollout(requests) -> (samples, metrics)   generate and score; async rewards overlap the rollout
  update(units, step) -> metrics            one training step on the actor group
  sync_weights() -> metrics                 actor -> rollout weights (nothing when colocated)
  set_old_logprob(mode)                     rollout-correction mode of the actor workers' algorithms
  save_state(dir) / load_state(dir)         the workers' files of a checkpoint
  close()
"""

from __future__ import annotations

from pathlib import Path

from omnirl_core.contracts import Executor, GenRequest, PolicyModel, Sample, TrainEngine, TrainingUnit
from omnirl_core.loop.worker import Worker, reference_placement
from omnirl_core.registry import load_object
from omnirl_core.resolve import ResolvedRun
from omnirl_core.rewards.dispatch import RewardFn, RewardSet, RewardStream


def build_rewards(resolved: ResolvedRun) -> RewardSet:
    fns = []
    for i, (entry, spec) in enumerate(zip(resolved.config.rewards, resolved.rewards)):
        fn = spec.load_factory()(resolved.options.get(f"rewards.{i}.options"))
        fns.append(RewardFn(entry.name, fn, entry.weight, entry.required))
    return RewardSet(fns, resolved.config.run.reward_timeout_s)


class InlineExecutor(Executor):
    name = "inline"

    def __init__(self, resolved: ResolvedRun):
        self.resolved = resolved
        self.worker: Worker | None = None
        self.reference: Worker | None = None
        self.rewards: RewardSet | None = None
        self.stream: RewardStream | None = None

    # the colocated worker's parts, for callers that inspect them
    @property
    def model(self) -> PolicyModel | None:
        return self.worker.model if self.worker else None

    @property
    def trainer(self) -> TrainEngine | None:
        return self.worker.trainer if self.worker else None

    def setup(self) -> None:
        run = self.resolved.config.run
        self.worker = Worker(self.resolved, {"actor", "rollout"})
        self.worker.setup()
        assert self.worker.algorithm is not None
        if reference_placement(self.resolved, self.worker.algorithm) == "separate":
            self.reference = Worker(self.resolved, {"reference"})
            self.reference.setup()
        self.rewards = build_rewards(self.resolved)
        self.stream = RewardStream(self.rewards, run.reward_workers * run.reward_concurrency, run.reward_mode,
                                   batch_async=run.reward_batching or self.rewards.batch_invariant)

    def rollout_threads(self) -> int | None:
        """Torch threads for a rollout that CPU-bound rewards overlap on the same cores, or None (leave them).

        Oversubscribed cores hurt both sides (torch's spinning intra-op threads starve the reward threads and
        the other way round), so the rollout gives up the CPUs the rewards declare: a reward worker needs
        the most any of the run's rewards declares (they run one after another), times the reward workers."""
        import torch

        run = self.resolved.config.run
        cpu = self.resolved.device is None or self.resolved.device.torch_device == "cpu"
        if self.stream is None or self.stream.mode != "async" or not cpu:
            return None
        if run.rollout_threads is not None:
            return run.rollout_threads
        need = max((spec.resources.get("CPU", 0.0) for spec in self.resolved.rewards), default=0.0)
        reserve = int(need * run.reward_workers * run.reward_concurrency)
        return max(1, torch.get_num_threads() - reserve) if reserve else None

    def rollout(self, requests: list[GenRequest], evaluation: bool = False) -> tuple[list[Sample], dict[str, float]]:
        """``evaluation``: sample with the weights the algorithm evaluates (``Algorithm.eval_policy``)."""
        import torch

        assert self.worker is not None and self.stream is not None
        self.worker.adapt_threads()  # run.threads: adaptive, at the step boundary (the pool the reward reserve is taken from)
        threads, before = self.rollout_threads(), torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            samples, timing = self.stream.run(self.worker.generate(requests, evaluation))
        finally:
            torch.set_num_threads(before)
        return samples, {**timing.metrics(), "rollout/threads": float(threads or before)}

    def generate(self, requests: list[GenRequest]) -> list[Sample]:
        assert self.worker is not None
        return list(self.worker.generate(requests))

    def score(self, samples: list[Sample]) -> None:
        assert self.rewards is not None
        self.rewards.score(samples)

    def update(self, units: list[TrainingUnit], step: int) -> dict[str, float]:
        assert self.worker is not None
        if self.reference is None:
            return self.worker.update(units, step)
        reference = self.reference
        return self.worker.update(units, step, reference=lambda: reference.reference_outputs(units))

    def sync_weights(self) -> dict[str, float]:
        return {}  # one model serves rollout and training

    def set_old_logprob(self, mode: str) -> None:
        assert self.worker is not None
        self.worker.set_old_logprob(mode)

    def save_state(self, directory: Path) -> list[str]:
        """The workers' part of a checkpoint (``omnirl_core.rundir.checkpoint`` writes the rest)."""
        assert self.worker is not None
        return self.worker.save_state(directory)

    def load_state(self, directory: Path) -> None:
        assert self.worker is not None
        self.worker.load_state(directory)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


EXECUTORS: dict[str, type[Executor] | str] = {"inline": InlineExecutor,
                                               "ray": "omnirl_core.loop.ray_executor:RayExecutor"}


def make_executor(resolved: ResolvedRun) -> Executor:
    return load_object(EXECUTORS[resolved.config.run.executor])(resolved)
