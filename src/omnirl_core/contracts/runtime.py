"""The runtime's own seams: an executor places the worker groups and the controller drives it; a training unit is
what an algorithm's update consumes; a tracker watches a run.

A device is declared by its spec alone (``omnirl_core.registry.DeviceSpec``: probe, torch device type,
distributed backend, Ray resource, visible-devices variable).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnirl_core.contracts.data import GenRequest, Sample
    from omnirl_core.loop.trackers import StepEvent, TrackerRun


class TrainingUnit:
    """Base of the units an algorithm trains on (``Algorithm.training_units``): a flow transition, a token
    sequence, a preference pair. ``sample`` is the sample a unit comes from (units of one sample stay in one
    minibatch; a Ray worker puts back the trajectory it kept). A unit of no single sample (a preference pair)
    declares ``sample: ClassVar[None] = None``."""

    sample: Sample | None


class Executor(ABC):
    """Places the worker groups (``inline``: one colocated worker in the controller's process; ``ray``: Ray
    actors on resource pools). The controller drives any executor through these methods only."""

    name: str

    @abstractmethod
    def setup(self) -> None:
        """Build the workers (each builds its own model, engines and algorithm instance) and the rewards."""

    @abstractmethod
    def rollout(self, requests: list[GenRequest], evaluation: bool = False) -> tuple[list[Sample], dict[str, float]]:
        """Generate and score every request (rewards overlap the rollout where they can); the samples and the
        phase's metrics. ``evaluation``: with the weights the algorithm evaluates."""

    @abstractmethod
    def update(self, units: list[TrainingUnit], step: int) -> dict[str, float]:
        """One training step of the actor group; its metrics."""

    @abstractmethod
    def sync_weights(self) -> dict[str, float]:
        """Actor -> rollout weights after an update (nothing when colocated); metrics."""

    @abstractmethod
    def set_old_logprob(self, mode: str) -> None:
        """Rollout correction's ``recompute`` / ``bypass`` switch on every actor worker's algorithm."""

    @abstractmethod
    def save_state(self, directory: Path) -> list[str]:
        """Every worker's part of a checkpoint, written into ``directory`` (on the driver); the paths written."""

    @abstractmethod
    def load_state(self, directory: Path) -> None:
        """Every worker loads its part of a checkpoint from ``directory`` (checksums verified)."""

    @abstractmethod
    def close(self) -> None:
        """Stop the workers and release what they hold."""

    def runtime(self) -> dict[str, Any]:
        """Facts of this invocation for ``runtime.json`` once ``setup`` has placed the workers (the Ray executor: the
        cluster and the node of every actor). Nothing by default."""
        return {}


class Tracker(ABC):
    """An experiment tracker (TensorBoard, W&B, ...), built by its spec's factory from its options.
    Whatever it raises is logged and the run goes on (``omnirl_core.loop.trackers``)."""

    @abstractmethod
    def start(self, run: TrackerRun) -> None:
        """Once, after the run directory is set up (and a checkpoint loaded, if any)."""

    @abstractmethod
    def log(self, event: StepEvent) -> None:
        """After each step's metrics row is written to metrics.jsonl."""

    def close(self) -> None:
        """At the end of the run, whatever ended it. Nothing by default."""
