"""The engine contracts: a rollout engine turns requests into samples with their typed trajectories; a train engine
turns an algorithm's units into optimizer steps, and saves and loads its own part of a checkpoint.

Contract suites: ``omnirl_core.testing.engines.check_rollout_engine`` and ``check_train_engine``.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from omnirl_core.algorithm import Algorithm
    from omnirl_core.contracts.data import GenRequest, Sample
    from omnirl_core.contracts.model import PolicyModel
    from omnirl_core.contracts.runtime import TrainingUnit

OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"


class RolloutEngine(ABC):
    """Built by the engine spec's factory as ``factory(model, options, device)``.

    ``generate`` yields each finished ``Sample`` as soon as it is complete (possibly out of order), with its
    request, its decoded output and the trajectory fields of its model kind (``omnirl_core.contracts.data.Sample``):
    the trainer re-evaluates exactly what the rollout computed, so the two log-probs agree.
    """

    @abstractmethod
    def generate(self, requests: list[GenRequest]) -> Iterator[Sample]:
        """Generate every request; yield finished samples as they complete."""

    def close(self) -> None:
        """Release what the engine holds outside this process (a server, an environment). Nothing by default."""


class TrainEngine(ABC):
    """Built by the engine spec's factory as ``factory(model, train_section, options, device)``; owns the
    optimizer. The default checkpoint part is a single process's: the trained weights in the model's own layout
    and the optimizer state (``optimizer.safetensors`` + ``optimizer.json``), written by rank 0."""

    distributed: ClassVar[bool] = False
    """Whether the engine trains across the ranks of a torch.distributed group (``run.train_workers`` > 1); an
    engine that does not is refused with more than one train worker."""

    model: PolicyModel
    optimizer: torch.optim.Optimizer

    @abstractmethod
    def update(self, algorithm: Algorithm, units: list[TrainingUnit], step: int,
               reference: Callable[[], list[dict[str, Any]]] | None = None) -> dict[str, float]:
        """One training step over ``units``; returns its metrics. ``reference``: fetches a separate reference
        worker's outputs for the units (``omnirl_core.loop.training.prepare_all``)."""

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The trained weights as whole CPU tensors (LoRA only when training LoRA): what weight sync sends and a
        checkpoint's exported weights hold. A sharded engine gathers them: a collective, every rank calls it."""
        return self.model.trained_state_dict()

    def rollout_elsewhere(self) -> None:
        """Called once after setup on a worker that does not roll out (a separate rollout worker samples): an engine
        that trains and scores its own copy of the weights may move the model's module off the accelerator. Nothing
        by default."""

    def save_state(self, directory: Path, rank: int) -> list[str]:
        """Write this engine's part of a checkpoint into ``directory``; returns the paths written. Every rank
        calls it (a sharded engine writes each rank's shard)."""
        if rank != 0:
            return []
        from safetensors.torch import save_file

        files = self.model.save_trained(directory)
        tensors, meta = optimizer_to_tensors(self.optimizer)
        save_file(tensors, str(directory / OPTIMIZER_TENSORS))
        (directory / OPTIMIZER_META).write_text(json.dumps(meta))
        return [*files, OPTIMIZER_TENSORS, OPTIMIZER_META]

    def load_state(self, directory: Path) -> None:
        """Load what ``save_state`` wrote (its checksums verified)."""
        from safetensors.torch import load_file

        from omnirl_core.rundir.checkpoint import read_json

        self.model.load_trained(directory)
        optimizer_from_tensors(self.optimizer, load_file(str(directory / OPTIMIZER_TENSORS)),
                               read_json(directory / OPTIMIZER_META))


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state into tensors (for safetensors) and JSON-able metadata; no pickle."""
    import torch

    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, pstate in state["state"].items():
        for key, value in pstate.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def optimizer_from_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                           meta: dict[str, Any]) -> None:
    """Restore ``optimizer_to_tensors``'s output into ``optimizer``."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        pid, _, key = name.partition(".")
        state.setdefault(int(pid), {})[key] = value
    for pid, values in meta.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(values)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
