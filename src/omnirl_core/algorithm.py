"""``Algorithm``: the base class of every algorithm plugin.

One class, three roles, each played by its own instance built from the same options and config:

- the **controller**'s instance (one per run, in the controller's process) decides what a step does:
  ``plan`` (the rollout plan of a step), ``assign_advantages``, ``training_units``. It must depend only on
  its options, the config and the step: under Ray it never sees what the actor's instance learns.
- the **actor**'s instance (one per train rank, in the worker process) turns units into gradients:
  ``prepare`` (no-grad pass: old log-probs), ``reference_prepare`` (the reference policy's outputs),
  ``loss``, ``finish_minibatch``, ``after_optimizer_step``, ``after_update``; it owns the checkpointed state
  (``state`` / ``state_tensors``) and decides which weights the rollout samples with (``rollout_policy`` when
  colocated, ``sync_policy`` for the export to a separate rollout worker) and which weights are evaluated and
  exported for use (``eval_policy``, e.g. an EMA of the trained weights).
- a **reference** worker's instance (``run.reference=separate``) runs only ``reference_prepare``.

Every optional method has a no-op default here, so the runtime calls them unconditionally.
The run-time switch of rollout correction (recompute or bypass the old log-probs) is ``old_logprob`` on the
instance, set by the runtime; the config object keeps what the user asked for.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import torch

    from omnirl_core.config import RunConfig
    from omnirl_core.contracts import PolicyModel, RolloutPlan, Sample, TrainEngine, TrainingUnit

ModelT = TypeVar("ModelT", bound="PolicyModel")
"""The model contract an algorithm trains (``FlowModel``, ``TokenModel``)."""
UnitT = TypeVar("UnitT", bound="TrainingUnit")
"""The training unit an algorithm makes and consumes (a transition, a sequence, a pair)."""

OLD_LOGPROB_MODES = ("recompute", "bypass")
ALGORITHM_STATE = "algorithm.json"
ALGORITHM_TENSORS = "algorithm.safetensors"
EVAL_WEIGHTS = "eval-weights"
"""A checkpoint's folder of the weights the algorithm evaluates (``has_eval_policy``): what `omnirl eval` loads."""


class Algorithm(Generic[ModelT, UnitT]):
    reference_fields: tuple[str, ...] = ()
    """What ``reference_prepare`` stores on each unit: what a separate reference worker sends back. Empty: the
    algorithm evaluates its reference only inside the actor (``run.reference=separate`` is refused)."""

    uses_reference: bool = False
    """Whether this configuration has a reference term (e.g. ``beta > 0``); set in ``__init__``."""

    controller_reads_trajectory: bool = True
    """Whether ``assign_advantages`` or ``training_units`` read a sample's trajectory (``latents``, ``sigmas``,
    ``logprobs``, ``extras``). False lets a colocated Ray worker keep the trajectories where it made them: the
    controller gets each sample without them (its request, output and rewards), and the update finds them in the
    worker's memory instead of receiving them back (``omnirl_core.loop.ray_executor``)."""

    has_eval_policy: bool = False
    """Whether ``eval_policy`` swaps in other weights than the trained ones (then checkpoints also hold those
    weights, in ``eval-weights/``); set in ``__init__``."""

    def __init__(self, options: Any, config: RunConfig):
        self.options = options  # the plugin's own (validated) options class: the base cannot know it
        self.config = config
        self.old_logprob: str = config.train.old_logprob

    @property
    def recompute(self) -> bool:
        """Rollout correction: recompute the old policy's log-probs before the update (else the rollout's)."""
        return self.old_logprob == "recompute"

    # -- controller ----------------------------------------------------------------------------
    def plan(self, step: int) -> RolloutPlan:
        """The ``RolloutPlan`` of ``step`` (which steps are stochastic, which are trained)."""
        raise NotImplementedError

    def assign_advantages(self, samples: list[Sample]) -> dict[str, float]:
        """Set ``sample.advantage`` on every sample of the step; returns metrics."""
        raise NotImplementedError

    def training_units(self, samples: list[Sample]) -> list[UnitT]:
        """The units the actor trains on (transitions, sequences, preference pairs)."""
        raise NotImplementedError

    # -- actor ---------------------------------------------------------------------------------
    def prepare(self, model: ModelT, units: list[UnitT]) -> dict[str, float]:
        """Without grad, before the update, per micro-batch: what the loss needs from the pre-update weights
        (old log-probs in recompute mode). The reference outputs are ``reference_prepare``'s job."""
        return {}

    def reference_prepare(self, model: ModelT, units: list[UnitT]) -> None:
        """Without grad, ``model`` being the reference policy: store ``reference_fields`` on each unit."""
        raise NotImplementedError(f"{type(self).__name__} declares no reference outputs")

    def loss(self, model: ModelT, units: list[UnitT], first_update: bool = False,
             correction: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of a micro-batch (a scalar tensor) and its metrics. ``correction``: see
        ``finish_minibatch``."""
        raise NotImplementedError

    def finish_minibatch(self, units: list[UnitT]) -> tuple[list[UnitT], dict[str, float]]:
        """After a minibatch's micro-batches, before its optimizer step: the units to re-run with
        ``loss(..., correction=True)`` (a rollout-correction mask that changed once the whole sample was seen)
        and sequence-level metrics."""
        return [], {}

    def after_optimizer_step(self, model: ModelT) -> None:
        """After each optimizer step of the update (a step's update takes one per minibatch), called by the
        train engine on every rank: e.g. fold it into an EMA of the trained weights."""

    def after_update(self, model: ModelT) -> None:
        """After the step's optimizer updates (e.g. fold them into an EMA)."""

    def state(self) -> dict[str, Any]:
        """JSON state saved with each checkpoint (``algorithm.json``)."""
        return {}

    def save_checkpoint(self, directory: Path, model: ModelT, engine: TrainEngine, rank: int) -> list[str]:
        """The algorithm's part of a checkpoint (every train rank calls it; the files written are returned):
        ``state()`` and ``state_tensors()`` (rank 0), and with ``has_eval_policy`` the weights it evaluates in
        ``eval-weights/`` (gathered by ``engine.trained_state``: a collective for a sharded engine)."""
        from omnirl_core.weights import export_trained_state

        files: list[str] = []
        if self.has_eval_policy:
            with self.eval_policy(model):
                full = export_trained_state(model, engine)
                written = model.save_trained(directory / EVAL_WEIGHTS, state=full) if rank == 0 else []
            files += [f"{EVAL_WEIGHTS}/{name}" for name in written]
        if rank != 0:
            return files
        state = self.state()
        if state:
            (directory / ALGORITHM_STATE).write_text(json.dumps(state, indent=2))
            files.append(ALGORITHM_STATE)
        tensors = self.state_tensors()
        if tensors:
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                      str(directory / ALGORITHM_TENSORS))
            files.append(ALGORITHM_TENSORS)
        return files

    def load_checkpoint(self, directory: Path, model: ModelT) -> None:
        """Load what ``save_checkpoint`` wrote (the checkpoint's checksums verified)."""
        from omnirl_core.rundir.checkpoint import read_json

        if (directory / ALGORITHM_STATE).is_file():
            self.load_state(read_json(directory / ALGORITHM_STATE))
        if (directory / ALGORITHM_TENSORS).is_file():
            from safetensors.torch import load_file

            self.load_state_tensors(load_file(str(directory / ALGORITHM_TENSORS)), model)

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore ``state()``."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors saved with each checkpoint (``algorithm.safetensors``)."""
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], model: ModelT) -> None:
        """Restore ``state_tensors()``."""

    # -- rollout (the actor's instance, colocated or exporting) ----------------------------------
    def rollout_policy(self, model: ModelT) -> AbstractContextManager[None]:
        """Around a rollout in the actor's process: the weights to sample with (default: the trained ones)."""
        return nullcontext()

    def sync_policy(self, model: ModelT) -> AbstractContextManager[None]:
        """Around the export of weights to a separate rollout worker (default: the trained ones)."""
        return nullcontext()

    def eval_policy(self, model: ModelT) -> AbstractContextManager[None]:
        """Around an evaluation during training, and the export of the weights a checkpoint offers for use
        (``eval-weights/``): the weights to evaluate (default: the trained ones; see ``has_eval_policy``)."""
        return nullcontext()


def lacks_reference(algorithm: Algorithm, units: Sequence[TrainingUnit]) -> bool:
    """Whether any unit still lacks the reference outputs (``reference_fields``: fields every unit declares, None
    until set)."""
    return any(getattr(u, name) is None for u in units for name in algorithm.reference_fields)
