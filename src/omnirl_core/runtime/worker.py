"""A worker: one process's share of a run. Roles: ``actor`` (model + train engine), ``rollout`` (model +
rollout engine), ``reference`` (the frozen base model, evaluated for the KL term when
``run.reference=separate``). ``actor`` and ``rollout`` together are colocated: one model, no weight copy.

The inline executor runs one worker in the controller's process; the Ray executor runs the same class
inside Ray actors, so both executors compute the very same numbers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from omnirl_core.errors import UsageError
from omnirl_core.interfaces import GenRequest, Sample
from omnirl_core.resolve import ResolvedRun
from omnirl_core.runtime.weight_sync import export_trained_state, import_trained_state

ROLES = frozenset({"actor", "rollout", "reference"})
OPTIMIZER_META = "optimizer.json"


def build_algorithm(resolved: ResolvedRun) -> Any:
    return resolved.algorithm.load_factory()(resolved.options.get("algorithm.options"), resolved.config)


def reference_placement(resolved: ResolvedRun, algorithm: Any) -> str | None:
    """Where the run's reference policy is evaluated: None (the algorithm uses none), 'actor' or 'separate'."""
    if not (resolved.algorithm.needs_reference and getattr(algorithm, "uses_reference", True)):
        return None
    if resolved.config.run.reference == "actor":
        return "actor"
    if not hasattr(algorithm, "reference_prepare"):
        raise UsageError(
            f"Algorithm '{resolved.algorithm.name}' evaluates its reference inside the actor only; "
            "run.reference=separate needs an algorithm with reference_prepare / reference_fields.",
            hint="Set run.reference=actor.",
        )
    return "separate"


def attach_reference(units: list[Any], payload: list[dict[str, Any]]) -> None:
    """Put a reference worker's outputs (``Worker.reference_outputs``) on the actor's copy of the units."""
    if len(payload) != len(units):
        raise RuntimeError(f"reference worker returned {len(payload)} results for {len(units)} units")
    for unit, fields in zip(units, payload):
        for name, value in fields.items():
            setattr(unit, name, value)


def torch_device(resolved: ResolvedRun) -> Any:
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
    def __init__(self, resolved: ResolvedRun, roles: frozenset[str] | set[str], algorithm: Any = None,
                 rank: int = 0, world_size: int = 1):
        unknown = set(roles) - ROLES
        if unknown or not roles:
            raise ValueError(f"worker roles must be a non-empty subset of {sorted(ROLES)}, got {sorted(roles)}")
        self.resolved = resolved
        self.roles = frozenset(roles)
        self.algorithm = algorithm
        self.rank = rank
        self.world_size = world_size
        self.model: Any = None
        self.rollout: Any = None
        self.trainer: Any = None

    def setup(self) -> None:
        import torch

        from omnirl_core.runtime.threads import configure

        r = self.resolved
        cfg = r.config
        self.threads = configure(cfg.run.threads)
        torch.manual_seed(cfg.run.seed)
        device = torch_device(r)
        self.model = r.model.load_factory()(cfg.model, r.options.get("model.options"), device)
        self.model.negative_prompt = cfg.rollout.negative_prompt  # what rollout engines encode for CFG
        # again after loading: adapters are initialised from torch's global random state, which loading
        # code may have used (or not, when a cache already held the model)
        torch.manual_seed(cfg.run.seed)
        if self.algorithm is None and self.roles & {"actor", "reference"}:
            self.algorithm = build_algorithm(r)
        if "actor" in self.roles:
            # with a separate reference worker the actor keeps no frozen copy (full fine-tuning)
            need_ref = reference_placement(r, self.algorithm) == "actor"
            self.model.setup_training(cfg.model.lora, need_reference=need_ref)
            self.trainer = r.train_engine.load_factory()(self.model, cfg.train, r.options.get("train.options"),
                                                         device)
        else:
            # a rollout-only worker carries the same adapter layout so that synced LoRA weights load; a
            # reference worker never trains: with LoRA it evaluates with the adapters disabled (the actor's
            # own reference path), in full fine-tuning the loaded weights are the reference
            self.model.setup_training(cfg.model.lora, need_reference=False)
        if "rollout" in self.roles:
            self.rollout = r.rollout_engine.load_factory()(self.model, r.options.get("rollout.options"), device)

    # -- rollout -------------------------------------------------------------------------------
    def generate(self, requests: list[GenRequest]) -> Iterator[Sample]:
        # optional algorithm hook: roll out with other weights than the trained ones (DiffusionNFT's EMA
        # sampler policy); a context manager around the whole rollout
        hook = getattr(self.algorithm, "rollout_policy", None)
        with hook(self.model) if hook is not None else nullcontext():
            yield from self.rollout.generate(requests)

    # -- reference -----------------------------------------------------------------------------
    def reference_outputs(self, units: list[Any]) -> list[dict[str, Any]]:
        """The reference policy's outputs for ``units`` (the algorithm's ``reference_fields``), computed
        without grad in micro-batches; what the actor would compute in its own ``prepare``."""
        import torch

        from omnirl_core.runtime.training import chunks

        context = self.model.reference() if getattr(self.model, "lora", None) is not None else nullcontext()
        with torch.no_grad(), context:
            for micro in chunks(units, self.resolved.config.train.micro_batch_size):
                self.algorithm.reference_prepare(self.model, micro)
        fields = self.algorithm.reference_fields
        return [{name: getattr(u, name) for name in fields} for u in units]

    # -- training ------------------------------------------------------------------------------
    def update(self, units: list[Any], step: int, algorithm: Any = None,
               reference: Callable[[], list[dict[str, Any]]] | None = None) -> dict[str, float]:
        """One training step. ``reference``: waits for a reference worker's outputs for ``units``; they are
        fetched after the actor's own no-grad pass (``training.prepare_all``), which overlaps them."""
        algorithm = algorithm or self.algorithm
        algorithm.pending_reference = reference
        try:
            metrics = self.trainer.update(algorithm, units, step)
        finally:
            algorithm.pending_reference = None
        # optional algorithm hook after the optimizer steps (DiffusionNFT folds them into its EMA sampler)
        if hasattr(algorithm, "after_update"):
            algorithm.after_update(self.model)
        return metrics

    def set_old_logprob(self, mode: str) -> None:
        """Rollout correction's recompute / bypass switch, read by the algorithm at every update."""
        self.resolved.config.train.old_logprob = mode
        if self.algorithm is not None and getattr(self.algorithm, "config", None) is not None:
            self.algorithm.config.train.old_logprob = mode

    # -- weight sync ---------------------------------------------------------------------------
    def trained_state(self) -> dict[str, Any] | None:
        """The weights a rollout worker needs (LoRA only, or the full denoiser); None on ranks > 0. An
        algorithm that samples with other weights than the trained ones (DiffusionNFT's EMA) swaps them in
        for the export through its optional ``sync_policy(model)`` hook."""
        hook = getattr(self.algorithm, "sync_policy", None)
        with hook(self.model) if hook is not None else nullcontext():
            state = export_trained_state(self.model, self.trainer)  # copies: the hook's swap is undone after
        return state if self.rank == 0 else None

    def load_trained_state(self, state: dict[str, Any]) -> None:
        import_trained_state(self.model, state)

    # -- checkpoints ---------------------------------------------------------------------------
    def save_state(self, directory: str | Path) -> list[str]:
        """Write this worker's part of a checkpoint into ``directory``: the trained weights in the layout
        diffusers reads (rank 0), the optimizer (rank 0, or every rank's shard for a sharded engine), and
        the algorithm's own state (rank 0; e.g. an EMA sampler policy or a reference snapshot)."""
        from safetensors.torch import save_file

        from omnirl_core.rundir.checkpoint import optimizer_to_tensors

        directory = Path(directory)
        if hasattr(self.trainer, "save_shards"):
            files = self.trainer.save_shards(directory)
            full = export_trained_state(self.model, self.trainer)
            if self.rank == 0:
                files += self.model.save_trained(directory, state=full)
        elif self.rank == 0:
            files = self.model.save_trained(directory)
            tensors, meta = optimizer_to_tensors(self.trainer.optimizer)
            save_file(tensors, str(directory / "optimizer.safetensors"))
            (directory / OPTIMIZER_META).write_text(json.dumps(meta))
            files += ["optimizer.safetensors", OPTIMIZER_META]
        else:
            files = []
        if self.rank == 0:
            files += save_algorithm_state(self.algorithm, directory)
        return files

    def load_state(self, directory: str | Path) -> None:
        """Load what ``save_state`` wrote (``omnirl_core.rundir.checkpoint`` has verified every file)."""
        from safetensors.torch import load_file

        from omnirl_core.rundir.checkpoint import optimizer_from_tensors, read_json

        directory = Path(directory)
        if hasattr(self.trainer, "load_shards"):
            self.trainer.load_shards(directory)
        else:
            self.model.load_trained(directory)
            if self.trainer is not None and (directory / "optimizer.safetensors").is_file():
                meta = read_json(directory / OPTIMIZER_META)
                optimizer_from_tensors(self.trainer.optimizer, load_file(str(directory / "optimizer.safetensors")),
                                       meta)
        if self.trainer is not None:
            load_algorithm_state(self.algorithm, self.model, directory)


ALGORITHM_STATE = "algorithm.json"
ALGORITHM_TENSORS = "algorithm.safetensors"


def save_algorithm_state(algorithm: Any, directory: Path) -> list[str]:
    """An algorithm's checkpointed state: ``state()`` (JSON) and ``state_tensors()`` (safetensors), both
    optional hooks; they live in the actor worker, where the algorithm updates them."""
    from safetensors.torch import save_file

    files = []
    if hasattr(algorithm, "state"):
        (directory / ALGORITHM_STATE).write_text(json.dumps(algorithm.state(), indent=2))
        files.append(ALGORITHM_STATE)
    tensors = algorithm.state_tensors() if hasattr(algorithm, "state_tensors") else {}
    if tensors:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(directory / ALGORITHM_TENSORS))
        files.append(ALGORITHM_TENSORS)
    return files


def load_algorithm_state(algorithm: Any, model: Any, directory: Path) -> None:
    from safetensors.torch import load_file

    from omnirl_core.rundir.checkpoint import read_json

    if (directory / ALGORITHM_STATE).is_file() and hasattr(algorithm, "load_state"):
        algorithm.load_state(read_json(directory / ALGORITHM_STATE))
    if (directory / ALGORITHM_TENSORS).is_file() and hasattr(algorithm, "load_state_tensors"):
        algorithm.load_state_tensors(load_file(str(directory / ALGORITHM_TENSORS)), model)
