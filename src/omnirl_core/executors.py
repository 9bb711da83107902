"""Executors place the worker groups. ``inline``: everything in the controller's process, one model shared
by rollout and training (colocated: no weight copy)."""

from __future__ import annotations

from typing import Any

from omnirl_core.interfaces import GenRequest, Sample
from omnirl_core.resolve import ResolvedRun
from omnirl_core.rewards import RewardFn, RewardSet


def build_rewards(resolved: ResolvedRun) -> RewardSet:
    fns = []
    for i, (entry, spec) in enumerate(zip(resolved.config.rewards, resolved.rewards)):
        fn = spec.load_factory()(resolved.options.get(f"rewards.{i}.options"))
        fns.append(RewardFn(entry.name, fn, entry.weight, entry.required))
    return RewardSet(fns)


class InlineExecutor:
    name = "inline"

    def __init__(self, resolved: ResolvedRun):
        self.resolved = resolved
        self.model: Any = None
        self.rollout: Any = None
        self.trainer: Any = None
        self.rewards: RewardSet | None = None

    def setup(self, algorithm: Any) -> None:
        import torch

        r = self.resolved
        cfg = r.config
        torch.manual_seed(cfg.run.seed)
        device = torch.device(r.device.torch_device if r.device else "cpu")
        self.model = r.model.load_factory()(cfg.model, r.options.get("model.options"), device)
        need_ref = r.algorithm.needs_reference and getattr(algorithm, "uses_reference", True)
        self.model.setup_training(cfg.model.lora, need_reference=need_ref)
        self.rollout = r.rollout_engine.load_factory()(self.model, r.options.get("rollout.options"), device)
        self.trainer = r.train_engine.load_factory()(self.model, cfg.train, r.options.get("train.options"), device)
        self.rewards = build_rewards(r)

    def generate(self, requests: list[GenRequest]) -> list[Sample]:
        return list(self.rollout.generate(requests))

    def score(self, samples: list[Sample]) -> dict[str, float]:
        assert self.rewards is not None
        return self.rewards.score(samples)

    def update(self, algorithm: Any, units: list[Any], step: int) -> dict[str, float]:
        return self.trainer.update(algorithm, units, step)

    def save(self, run_dir, step: int, extra: dict[str, Any]):
        from omnirl_core.checkpoint import save_checkpoint

        return save_checkpoint(run_dir, step, self.model, self.trainer.optimizer, extra)

    def load(self, path) -> dict[str, Any]:
        from omnirl_core.checkpoint import load_checkpoint

        return load_checkpoint(path, self.model, self.trainer.optimizer)

    def close(self) -> None:
        pass


EXECUTORS = {"inline": InlineExecutor}
