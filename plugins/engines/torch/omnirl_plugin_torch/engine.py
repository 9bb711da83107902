"""Single-process training engine.

One training step: (1) without grad, ``algorithm.prepare`` over every unit (old log-probs, reference
outputs); (2) the units are split into ``minibatches`` of whole samples; each minibatch accumulates
gradients over micro-batches (plus the rare rollout-correction fix-ups, ``training.rs_corrections``) and
takes one optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.config import TrainSection
from omnirl_core.contracts import TrainEngine
from omnirl_core.loop.training import (
    MetricMean,
    chunks,
    finite_update,
    micro_batch,
    minibatches,
    prepare_all,
    prepare_batch,
    rs_corrections,
)


class TorchTrainOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shuffle: bool = Field(True, description="Shuffle units (seeded by step) before splitting into minibatches.")


class TorchTrainEngine(TrainEngine):
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

    def update(self, algorithm: Any, units: list[Any], step: int,
               reference: Callable[[], list[dict[str, Any]]] | None = None) -> dict[str, float]:
        """One training step; ``reference``: a separate reference worker's outputs (``training.prepare_all``)."""
        metrics = MetricMean()
        prepare_all(algorithm, self.model, units, prepare_batch(self.train, len(units)), metrics, reference)
        params = self.model.trainable_parameters()
        for index, minibatch in enumerate(minibatches(units, self.train.minibatches, step, self.options.shuffle)):
            self.optimizer.zero_grad(set_to_none=True)
            mbs = micro_batch(self.train, len(minibatch))
            losses = []
            for micro in chunks(minibatch, mbs):
                loss, m = algorithm.loss(self.model, micro, first_update=index == 0)
                (loss * (len(micro) / len(minibatch))).backward()
                losses.append(float(loss.detach()))
                metrics.add({"loss": losses[-1], **m}, len(micro))
            for micro in chunks(rs_corrections(algorithm, minibatch, metrics), mbs):
                loss, _ = algorithm.loss(self.model, micro, correction=True)
                (loss * (len(micro) / len(minibatch))).backward()
                losses.append(float(loss.detach()))
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.train.max_grad_norm))
            if finite_update(grad_norm, losses, step, index, self.train.nonfinite, metrics):
                metrics.add({"grad_norm": grad_norm}, 1.0)
                self.optimizer.step()
                algorithm.after_optimizer_step(self.model)  # e.g. FlowGRPO's EMA of the weights
            self.optimizer.zero_grad(set_to_none=True)
        return metrics.result()
