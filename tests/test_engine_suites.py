"""The engine contract suites (``omnirl_core.testing.engines``) pass a correct engine and catch broken ones: seeds
ignored, the unconditional branch dropped, log-probs the trainer cannot reproduce, a sample without its request,
an optimizer state that does not come back from a checkpoint. The engines here are minimal ones over the core's
helpers (no engine plugin)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from omnirl_core.contracts import GenRequest, RolloutEngine, Sample, TrainEngine
from omnirl_core.loop.training import MetricMean, chunks, prepare_all
from omnirl_core.testing import rollout
from omnirl_core.testing.engines import check_rollout_engine, check_train_engine, toy_flow_model


@pytest.fixture(scope="module")
def model():
    return toy_flow_model()


class MinimalRollout(RolloutEngine):
    """The core's minimal rollout per (plan, guidance, size) batch; ``corrupt`` alters what it hands out."""

    def __init__(self, model: Any, corrupt: Callable[[list[GenRequest], list[Sample]], None] | None = None):
        self.model = model
        self.corrupt = corrupt

    def generate(self, requests: list[GenRequest]) -> Iterator[Sample]:
        batches: dict[tuple[Any, ...], list[GenRequest]] = {}
        for r in requests:
            batches.setdefault((r.plan, r.guidance_scale, r.height, r.width), []).append(r)
        for batch in batches.values():
            samples = rollout(self.model, batch, negative_prompt=self.model.negative_prompt)
            if self.corrupt is not None:
                self.corrupt(batch, samples)
            yield from reversed(samples)  # out of order is allowed


def test_a_correct_rollout_engine_passes(model):
    samples = check_rollout_engine(lambda m: MinimalRollout(m), model=model)
    assert [s.request.uid for s in samples] == list(range(6))


class SeedIgnoring(MinimalRollout):
    """Every request drawn with seed 0 (the samples then carry their own requests again)."""

    def generate(self, requests: list[GenRequest]) -> Iterator[Sample]:
        by_uid = {r.uid: r for r in requests}
        fixed = []
        for r in requests:
            fixed.append(copy.copy(r))
            fixed[-1].seed = 0
        for s in super().generate(fixed):
            s.request = by_uid[s.request.uid]
            yield s


def _drop_uncond(batch: list[GenRequest], samples: list[Sample]) -> None:
    for s in samples:
        s.uncond = None


def _shift_logprobs(batch: list[GenRequest], samples: list[Sample]) -> None:
    for s in samples:
        s.logprobs = s.logprobs + 1e-3


def _swap_requests(batch: list[GenRequest], samples: list[Sample]) -> None:
    if len(samples) > 1:
        samples[0].request, samples[1].request = samples[1].request, samples[0].request


@pytest.mark.parametrize("build,message", [
    (lambda m: SeedIgnoring(m), "the request's seed is not used"),
    (lambda m: MinimalRollout(m, _drop_uncond), "without its unconditional conditioning"),
    (lambda m: MinimalRollout(m, _shift_logprobs), "the trainer's log-probs differ from the rollout's"),
    (lambda m: MinimalRollout(m, _swap_requests), "generated twice differs"),
], ids=["seed-ignored", "uncond-dropped", "logprobs-off", "requests-swapped"])
def test_a_broken_rollout_engine_fails(model, build, message: str):
    with pytest.raises(AssertionError, match=message):
        check_rollout_engine(build, model=model)


class MinimalTrain(TrainEngine):
    """AdamW over the trainable parameters, one optimizer step per update; the contract's default checkpoint
    part unless ``forget_optimizer``."""

    def __init__(self, model: Any, train: Any, forget_optimizer: bool = False):
        self.model = model
        self.train = train
        self.forget_optimizer = forget_optimizer
        self.optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=train.lr)

    def update(self, algorithm: Any, units: list[Any], step: int, reference: Any = None) -> dict[str, float]:
        metrics = MetricMean()
        prepare_all(algorithm, self.model, units, self.train.micro_batch_size, metrics, reference)
        self.optimizer.zero_grad(set_to_none=True)
        for micro in chunks(units, self.train.micro_batch_size):
            loss, m = algorithm.loss(self.model, micro, first_update=True)
            (loss * len(micro) / len(units)).backward()
            metrics.add({"loss": float(loss.detach()), **m}, len(micro))
        norm = torch.nn.utils.clip_grad_norm_(self.model.trainable_parameters(), self.train.max_grad_norm)
        metrics.add({"grad_norm": float(norm)}, 1.0)
        self.optimizer.step()
        return metrics.result()

    def load_state(self, directory: Path) -> None:
        if self.forget_optimizer:
            self.model.load_trained(directory)
        else:
            super().load_state(directory)


def test_a_correct_train_engine_passes(tmp_path: Path):
    metrics = check_train_engine(lambda m, train: MinimalTrain(m, train), directory=tmp_path)
    assert metrics["grad_norm"] > 0 and (tmp_path / "optimizer.safetensors").is_file()


def test_a_train_engine_that_loses_its_optimizer_state_fails(tmp_path: Path):
    with pytest.raises(AssertionError, match="optimizer state"):
        check_train_engine(lambda m, train: MinimalTrain(m, train, forget_optimizer=True), directory=tmp_path)


def test_a_train_engine_that_does_not_train_fails(tmp_path: Path):
    class Frozen(MinimalTrain):
        def update(self, algorithm: Any, units: list[Any], step: int, reference: Any = None) -> dict[str, float]:
            return {"loss": 0.0, "grad_norm": 0.0}

    with pytest.raises(AssertionError, match="left every trained weight unchanged"):
        check_train_engine(lambda m, train: Frozen(m, train), directory=tmp_path)
