"""A worker: one process's share of a run. Roles: ``actor`` (model + train engine), ``rollout`` (model +
rollout engine), ``reference`` (the frozen base model, evaluated for the KL term when
``run.reference=separate``). ``actor`` and ``rollout`` together are colocated: one model, no weight copy.

The inline executor runs one worker in the controller's process; the Ray executor runs the same class
inside Ray actors, so both executors compute the very same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from omnirl_core.algorithm import Algorithm
from omnirl_core.contracts import GenRequest, PolicyModel, RolloutEngine, Sample, TrainEngine, TrainingUnit
from omnirl_core.errors import PluginError, UsageError
from omnirl_core.flow.model import cfg_gradient
from omnirl_core.precision import offload_frozen, upcast_adapters
from omnirl_core.registry import ComponentSpec
from omnirl_core.resolve import ResolvedRun
from omnirl_core.weights import export_trained_state, import_trained_state

if TYPE_CHECKING:
    import torch

    from omnirl_core.host.threads import ThreadGovernor

T = TypeVar("T")
ROLES = frozenset({"actor", "rollout", "reference"})


def build_algorithm(resolved: ResolvedRun) -> Algorithm:
    """One instance of the run's algorithm (each role builds its own: see ``omnirl_core.algorithm``)."""
    algorithm = resolved.algorithm.load_factory()(resolved.options.get("algorithm.options"), resolved.config)
    if not isinstance(algorithm, Algorithm):
        raise PluginError(
            f"Algorithm '{resolved.algorithm.name}' built a {type(algorithm).__name__}, not an "
            "omnirl_core.algorithm.Algorithm.",
            hint="Subclass omnirl_core.algorithm.Algorithm (or FlowPolicyGradient / TokenPolicyGradient).",
        )
    return algorithm


def built(spec: ComponentSpec, contract: type[T], obj: object) -> T:
    """A factory's result, checked against the contract its kind declares (``omnirl_core.contracts``)."""
    if not isinstance(obj, contract):
        raise PluginError(
            f"The {spec.kind} '{spec.name}' (plugin '{spec.plugin}') built a {type(obj).__name__}, which is not an "
            f"omnirl_core.contracts.{contract.__name__}.",
            hint=f"Subclass omnirl_core.contracts.{contract.__name__} (CONTRIBUTING.md lists what it declares).",
        )
    return obj


def reference_placement(resolved: ResolvedRun, algorithm: Algorithm) -> str | None:
    """Where the run's reference policy is evaluated: None (the algorithm uses none), 'actor' or 'separate'."""
    if not (resolved.algorithm.needs_reference and algorithm.uses_reference):
        return None
    if resolved.config.run.reference == "actor":
        return "actor"
    if not algorithm.reference_fields:
        raise UsageError(
            f"Algorithm '{resolved.algorithm.name}' evaluates its reference inside the actor only; "
            "run.reference=separate needs an algorithm with reference_prepare / reference_fields.",
            hint="Set run.reference=actor.",
        )
    return "separate"


def compile_trained(model: PolicyModel) -> None:
    """``model.compile``: each trained module's forward through ``torch.compile`` (inductor), in place, after the
    engines have wrapped it (its parameters and state-dict keys stay as they are, so checkpoints and weight sync do
    not change). Shapes are dynamic: the rollout's, the update's and the reference's batch sizes share one graph
    (the reference's disabled adapters add one more)."""
    for module in model.trained_modules().values():
        module.compile(dynamic=True)


def torch_device(resolved: ResolvedRun) -> torch.device:
    """The worker's torch device. Executors restrict each worker to its own accelerators through the
    device's visible-devices variable, so index 0 is this worker's one. A device whose torch support is
    an extension (Ascend's torch-npu) registers it in its probe, called here in every worker."""
    import torch

    spec = resolved.device
    if spec is None or spec.torch_device == "cpu":
        return torch.device("cpu")
    if spec.available() <= 0:
        raise UsageError(f"Device '{spec.name}' is not available in this worker process.",
                         hint=f"Check {spec.visible_devices_env or 'the device setup'} and the Ray resources.")
    return torch.device(spec.torch_device)


class Worker:
    def __init__(self, resolved: ResolvedRun, roles: frozenset[str] | set[str], rank: int = 0, world_size: int = 1):
        unknown = set(roles) - ROLES
        if unknown or not roles:
            raise ValueError(f"worker roles must be a non-empty subset of {sorted(ROLES)}, got {sorted(roles)}")
        self.resolved = resolved
        self.roles = frozenset(roles)
        self.algorithm: Algorithm | None = None  # the actor's (or reference's) own instance
        self.rank = rank
        self.world_size = world_size
        self.model: PolicyModel = None  # type: ignore[assignment]  # built by setup()
        self.rollout: RolloutEngine | None = None
        self.trainer: TrainEngine | None = None
        self.governor: ThreadGovernor | None = None
        self._adapted = False  # the pool was re-judged this step (by the rollout on this worker)

    def adapt_threads(self) -> dict[str, float]:
        """At a step boundary, before the rollout (``run.threads: adaptive``, the default): the torch pool resized
        to the cores this process gets; the count and the wait share that set it, as metrics. Nothing with a
        fixed pool."""
        if self.governor is None:
            return {}
        self.governor.observe()
        self._adapted = True
        return self.thread_metrics()

    def thread_metrics(self) -> dict[str, float]:
        """The pool this step runs on (a step's rollout and update share it: the trainer re-evaluates the
        rollout's log-probs with the same arithmetic) and the wait share that set it."""
        if self.governor is None:
            return {}
        return {"threads/torch": float(self.governor.threads), "threads/wait_share": self.governor.wait_share,
                "threads/cpus_taken": float(self.governor.cpus_taken)}

    def setup(self) -> None:
        import torch

        from omnirl_core.host.quiet import show_repeats_once
        from omnirl_core.host.threads import configure, governor

        r = self.resolved
        cfg = r.config
        self.threads = configure(cfg.run.threads)
        self.governor = governor(self.threads)  # run.threads: adaptive (the default)
        torch.manual_seed(cfg.run.seed)
        device = torch_device(r)
        self.model = built(r.model, PolicyModel, r.model.load_factory()(cfg.model, r.options.get("model.options"), device))
        if cfg.model.offload == "cpu":
            offload_frozen(self.model.frozen_modules(), device)
        self.model.negative_prompt = cfg.rollout.negative_prompt  # what rollout engines encode for CFG
        show_repeats_once()  # the libraries' loggers exist now; a warning per prompt would flood stderr
        # again after loading: adapters are initialised from torch's global random state, which loading
        # code may have used (or not, when a cache already held the model)
        torch.manual_seed(cfg.run.seed)
        if self.roles & {"actor", "reference"}:
            self.algorithm = build_algorithm(r)
        if "actor" in self.roles:
            assert self.algorithm is not None
            # with a separate reference worker the actor keeps no frozen copy (full fine-tuning)
            need_ref = reference_placement(r, self.algorithm) == "actor"
            self.model.setup_training(cfg.model.lora, need_reference=need_ref)
            if cfg.model.lora.enabled:  # the adapters' float32 master copy
                upcast_adapters(self.model.trainable_parameters())
            self.trainer = built(r.train_engine, TrainEngine, r.train_engine.load_factory()(
                self.model, cfg.train, r.options.get("train.options"), device))
        else:
            # a rollout-only worker carries the same adapter layout so that synced LoRA weights load; a
            # reference worker never trains: with LoRA it evaluates with the adapters disabled (the actor's
            # own reference path), in full fine-tuning the loaded weights are the reference
            self.model.setup_training(cfg.model.lora, need_reference=False)
            if cfg.model.lora.enabled:  # the adapters' float32 master copy
                upcast_adapters(self.model.trainable_parameters())
        if "rollout" in self.roles:
            self.rollout = built(r.rollout_engine, RolloutEngine, r.rollout_engine.load_factory()(
                self.model, r.options.get("rollout.options"), device))
        elif self.trainer is not None:
            self.trainer.rollout_elsewhere()
        if cfg.model.compile:
            compile_trained(self.model)

    # -- rollout -------------------------------------------------------------------------------
    def generate(self, requests: list[GenRequest], evaluation: bool = False) -> Iterator[Sample]:
        """``evaluation``: with the weights the algorithm evaluates (``eval_policy``, e.g. FlowGRPO's EMA)."""
        # the actor's algorithm may roll out with other weights than the trained ones (DiffusionNFT's EMA
        # sampler policy); a separate rollout worker gets those through ``sync_policy`` instead
        colocated = self.algorithm is not None and "actor" in self.roles
        assert self.rollout is not None
        policy: AbstractContextManager[None]
        if not colocated or self.algorithm is None:
            policy = nullcontext()
        elif evaluation:
            policy = self.algorithm.eval_policy(self.model)
        else:
            policy = self.algorithm.rollout_policy(self.model)
        with policy:
            yield from self.rollout.generate(requests)

    # -- reference -----------------------------------------------------------------------------
    def reference_outputs(self, units: list[TrainingUnit]) -> list[dict[str, Any]]:
        """The reference policy's outputs for ``units`` (the algorithm's ``reference_fields``), computed
        without grad in micro-batches; what the actor would compute in its own ``prepare``."""
        import torch

        from omnirl_core.loop.training import chunks, prepare_batch

        assert self.algorithm is not None
        context = self.model.reference() if self.model.lora is not None else nullcontext()
        with torch.no_grad(), context:
            for micro in chunks(units, prepare_batch(self.resolved.config.train, len(units))):
                self.algorithm.reference_prepare(self.model, micro)
        fields = self.algorithm.reference_fields
        return [{name: getattr(u, name) for name in fields} for u in units]

    # -- training ------------------------------------------------------------------------------
    def update(self, units: list[TrainingUnit], step: int,
               reference: Callable[[], list[dict[str, Any]]] | None = None) -> dict[str, float]:
        """One training step. ``reference``: waits for a reference worker's outputs for ``units``; they are
        fetched after the actor's own no-grad pass (``training.prepare_all``), which overlaps them."""
        assert self.algorithm is not None and self.trainer is not None
        if not self._adapted:
            self.adapt_threads()  # a worker that only trains (Ray, apart from the rollout): its step starts here
        self._adapted = False
        with cfg_gradient(self.resolved.config.train.cfg_grad):  # the training forwards' CFG gradient
            metrics = self.trainer.update(self.algorithm, units, step, reference=reference)
        self.algorithm.after_update(self.model)  # e.g. DiffusionNFT folds the update into its EMA sampler
        return {**metrics, **self.thread_metrics()}  # the pool the step ran on

    def set_old_logprob(self, mode: str) -> None:
        """Rollout correction's recompute / bypass switch, read by the algorithm at every update."""
        if self.algorithm is not None:
            self.algorithm.old_logprob = mode

    # -- weight sync ---------------------------------------------------------------------------
    def trained_state(self, evaluation: bool = False) -> dict[str, torch.Tensor] | None:
        """The weights a rollout worker needs (LoRA only, or the full denoiser); None on ranks > 0. An
        algorithm that samples with other weights than the trained ones (DiffusionNFT's EMA) swaps them in
        for the export through its ``sync_policy(model)`` hook; ``evaluation``: the weights it evaluates
        (``eval_policy``)."""
        policy: AbstractContextManager[None]
        if self.algorithm is None:
            policy = nullcontext()
        else:
            policy = (self.algorithm.eval_policy if evaluation else self.algorithm.sync_policy)(self.model)
        with policy:
            state = export_trained_state(self.model, self.trainer)  # copies: the hook's swap is undone after
        return state if self.rank == 0 else None

    def load_trained_state(self, state: dict[str, torch.Tensor]) -> None:
        import_trained_state(self.model, state)

    # -- checkpoints ---------------------------------------------------------------------------
    def save_state(self, directory: str | Path) -> list[str]:
        """Write this worker's part of a checkpoint into ``directory``: each component its own files (the train
        engine: trained weights and optimizer; the algorithm: its state and the weights it evaluates). Returns
        the paths written."""
        directory = Path(directory)
        if self.trainer is None:  # a rollout or reference worker keeps nothing of its own
            return []
        files = self.trainer.save_state(directory, self.rank)
        if self.algorithm is not None:
            files += self.algorithm.save_checkpoint(directory, self.model, self.trainer, self.rank)
        return files

    def load_state(self, directory: str | Path) -> None:
        """Load what ``save_state`` wrote (every file's checksum has been verified). A worker without a train
        engine (a rollout worker) loads the trained weights only."""
        directory = Path(directory)
        if self.trainer is None:
            self.model.load_trained(directory)
            return
        self.trainer.load_state(directory)
        if self.algorithm is not None:
            self.algorithm.load_checkpoint(directory, self.model)
