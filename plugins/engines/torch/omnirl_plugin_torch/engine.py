"""Single-process training engine.

One training step: (1) without grad, ``algorithm.prepare`` over every unit (old log-probs, reference
outputs); (2) the units are split into ``minibatches``; each minibatch accumulates gradients over
micro-batches and takes one optimizer step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.config import TrainSection


class TorchTrainOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shuffle: bool = Field(True, description="Shuffle units (seeded by step) before splitting into minibatches.")


def chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


class MetricMean:
    """Averages metrics weighted by how many units each value covers; '*_max' keys keep the maximum."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.maxes: dict[str, float] = {}

    def add(self, metrics: dict[str, float], weight: float) -> None:
        for key, value in metrics.items():
            if key.endswith("_max"):
                self.maxes[key] = max(self.maxes.get(key, float("-inf")), float(value))
            else:
                self.sums[key] += float(value) * weight
                self.weights[key] += weight

    def result(self) -> dict[str, float]:
        out = {k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}
        out.update(self.maxes)
        return out


class TorchTrainEngine:
    def __init__(self, model: Any, train: TrainSection, options: TorchTrainOptions | None, device: Any):
        self.model = model
        self.train = train
        self.options = options or TorchTrainOptions()
        params = model.trainable_parameters()
        if not params:
            raise ValueError("the model has no trainable parameters (LoRA not added / everything frozen)")
        self.optimizer = torch.optim.AdamW(
            params, lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay
        )

    def update(self, algorithm: Any, units: list[Any], step: int) -> dict[str, float]:
        metrics = MetricMean()
        mbs = self.train.micro_batch_size
        with torch.no_grad():
            for micro in chunks(units, mbs):
                metrics.add(algorithm.prepare(self.model, micro), len(micro))
        order = list(range(len(units)))
        if self.options.shuffle:
            order = torch.randperm(len(units), generator=torch.Generator().manual_seed(step)).tolist()
        ordered = [units[i] for i in order]
        n_mb = min(self.train.minibatches, len(units))
        size = -(-len(units) // n_mb)
        params = self.model.trainable_parameters()
        for index, minibatch in enumerate(chunks(ordered, size)):
            self.optimizer.zero_grad(set_to_none=True)
            for micro in chunks(minibatch, mbs):
                loss, m = algorithm.loss(self.model, micro, first_update=index == 0)
                (loss * (len(micro) / len(minibatch))).backward()
                metrics.add({"loss": float(loss.detach()), **m}, len(micro))
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.train.max_grad_norm)
            metrics.add({"grad_norm": float(grad_norm)}, 1.0)
            self.optimizer.step()
        return metrics.result()
