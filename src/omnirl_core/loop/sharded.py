"""What every data-parallel, sharded train engine shares (fsdp2, veomni): the step over ranks and the sharded
checkpoint. A subclass wraps the trained modules its own way (``torch.distributed.fsdp.fully_shard``, VeOmni's
parallelize API), fills ``named_params`` and ``optimizer``, and says how the gradient norm is clipped.

One training step, on every rank: (1) ``algorithm.prepare`` over every unit without grad (each rank computes the
same old log-probs and reference outputs, so no gather is needed); (2) the units are shuffled by sample (seeded by
step) and split into ``minibatches``; each rank takes every world-th sample (whole, with all its trained steps)
of a minibatch and runs as many micro-batches as the busiest rank (collectives must pair up); the loss is scaled
so that the reduced gradient equals the single-process engine's; rollout-correction fix-ups are agreed on; then
one optimizer step, taken or skipped alike on every rank (the norm is all-reduced).

Checkpoints are sharded safetensors: ``shards/rank-RRRRR-of-WWWWW.safetensors`` holds each rank's local shards of
the trainable parameters and their AdamW state; ``shards/index.json`` the world size, shapes and optimizer
hyperparameters; rank 0 also writes the gathered trained weights in the model's own layout (what diffusers / peft
read). They load back on the same or another number of ranks (the full tensor is rebuilt from the dim-0 shards,
then redistributed). No pickle.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, distribute_tensor

from omnirl_core.config import TrainSection
from omnirl_core.contracts import TrainEngine
from omnirl_core.contracts.runtime import TrainingUnit
from omnirl_core.loop.training import (
    MetricMean,
    finite_update,
    micro_batch,
    minibatches,
    prepare_all,
    prepare_batch,
    rank_share,
    rs_corrections,
    split_even,
)

if TYPE_CHECKING:
    from omnirl_core.algorithm import Algorithm

SHARD_DIR = "shards"
OPTIM_KEYS = ("exp_avg", "exp_avg_sq", "step")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a (possibly) distributed tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathered from every rank when distributed (a collective)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class ShardedTrainEngine(TrainEngine):
    """A data-parallel train engine whose parameters and optimizer state are DTensor shards (FSDP2 layout).

    A subclass's ``__init__`` sets ``model``, ``train``, ``rank``, ``world_size``, ``comm_device`` (where small
    collectives live: the device for nccl), ``shuffle``, ``named_params`` (checkpoint name, parameter) and
    ``optimizer`` (AdamW-style state: ``exp_avg``, ``exp_avg_sq``, ``step``), and implements ``clip_grad_norm``.

    An engine whose ranks split each sample's sequence (sequence parallelism) sets ``data_rank`` / ``data_size``: the
    ranks of one sequence-parallel group take the same samples (the group's ``data_rank``) and ``training`` switches the
    split forward on for the update; the gradients are still averaged over every rank (the FSDP mesh).
    """

    distributed = True
    model: Any
    train: TrainSection
    rank: int
    world_size: int
    comm_device: torch.device
    shuffle: bool
    named_params: list[tuple[str, torch.nn.Parameter]]
    optimizer: torch.optim.Optimizer

    data_rank: int | None = None  # None: ``rank`` (every rank its own samples)
    data_size: int | None = None  # None: ``world_size``

    def clip_grad_norm(self) -> float:
        """Clip the gradients to ``train.max_grad_norm`` and return their norm over every rank's shards (the same
        number on every rank: a collective)."""
        raise NotImplementedError

    def training(self) -> contextlib.AbstractContextManager[None]:
        """What the update runs under (a sequence-parallel forward); by default nothing."""
        return contextlib.nullcontext()

    # -- update --------------------------------------------------------------------------------
    def update(self, algorithm: Algorithm, units: list[TrainingUnit], step: int,
               reference: Callable[[], list[dict[str, Any]]] | None = None) -> dict[str, float]:
        """One training step; ``reference``: a separate reference worker's outputs (``training.prepare_all``)."""
        with self.training():
            return self._update(algorithm, units, step, reference)

    def _update(self, algorithm: Algorithm, units: list[TrainingUnit], step: int,
                reference: Callable[[], list[dict[str, Any]]] | None) -> dict[str, float]:
        metrics = MetricMean()
        data_rank, data_size = self._data_rank(), self._data_size()
        prepare_all(algorithm, self.model, units, prepare_batch(self.train, len(units)), metrics, reference)
        for index, minibatch in enumerate(minibatches(units, self.train.minibatches, step, self.shuffle)):
            self.optimizer.zero_grad(set_to_none=True)
            mine = rank_share(minibatch, data_rank, data_size)
            # every rank runs as many micro-batches as the busiest one: FSDP's collectives must pair up
            busiest = max(len(rank_share(minibatch, r, data_size)) for r in range(data_size))
            mbs = micro_batch(self.train, busiest)
            for micro in split_even(mine, -(-busiest // mbs)):
                loss, m = self._backward(algorithm, micro, minibatch, first_update=index == 0)
                metrics.add({"loss": float(loss.detach()), **m}, len(micro))  # an empty share: names only
            # rollout-correction fix-ups (bypass mode, rare): their count differs per rank, so agree on it
            fix = rs_corrections(algorithm, mine, metrics, filler=minibatch[:1])
            count = torch.tensor([-(-len(fix) // mbs)], dtype=torch.int64, device=self.comm_device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            for micro in split_even(fix, int(count.item())):
                self._backward(algorithm, micro, minibatch, correction=True)
            # the norm is all-reduced, so every rank takes the same decision (a NaN on any rank poisons it)
            grad_norm = self.clip_grad_norm()
            if finite_update(grad_norm, [], step, index, self.train.nonfinite, metrics):
                metrics.add({"grad_norm": grad_norm}, 1.0 / self.world_size)
                self.optimizer.step()
                algorithm.after_optimizer_step(self.model)  # e.g. FlowGRPO's EMA of the weights
            self.optimizer.zero_grad(set_to_none=True)
        metrics.all_reduce(self.comm_device)
        return metrics.result()

    def _backward(self, algorithm: Algorithm, micro: list[Any], minibatch: list[Any],
                  **kwargs: Any) -> tuple[torch.Tensor, dict[str, float]]:
        # an empty share still joins the collectives, with a zero-weight forward/backward
        loss, m = algorithm.loss(self.model, micro or minibatch[:1], **kwargs)
        # FSDP averages gradients over ranks: scale by the number of data shards so they sum, like one process (the
        # ranks of a sequence-parallel group hold one shard: their gradients average to that shard's)
        (loss * (len(micro) / len(minibatch) * self._data_size())).backward()
        return loss, m

    def _data_rank(self) -> int:
        return self.rank if self.data_rank is None else self.data_rank

    def _data_size(self) -> int:
        return self.world_size if self.data_size is None else self.data_size

    # -- weights for sync and export -----------------------------------------------------------
    def trained_state(self) -> dict[str, torch.Tensor]:
        """The trained weights as full CPU tensors (LoRA only when training LoRA). Collective: every rank
        calls it."""
        return {k: full(v).detach().cpu().contiguous() for k, v in self.model.trained_state_dict().items()}

    # -- sharded checkpoints -------------------------------------------------------------------
    def _shard_file(self, directory: Path, rank: int, world: int) -> Path:
        return directory / SHARD_DIR / f"rank-{rank:05d}-of-{world:05d}.safetensors"

    def save_state(self, directory: Path, rank: int) -> list[str]:
        """Every rank writes its shard of the parameters and optimizer state; rank 0 also writes the gathered
        trained weights in the model's own layout. Collective."""
        files = self._save_shards(Path(directory))
        state = self.trained_state()  # a collective: every rank
        if rank == 0:
            files += self.model.save_trained(directory, state=state)
        return files

    def load_state(self, directory: Path) -> None:
        """Each rank's shards (resharded when the checkpoint has another world size)."""
        self._load_shards(Path(directory))

    def _save_shards(self, directory: Path) -> list[str]:
        (directory / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        for name, param in self.named_params:
            tensors[f"param/{name}"] = local(param.detach()).cpu().contiguous()
            for key, value in self.optimizer.state.get(param, {}).items():
                if torch.is_tensor(value):
                    tensors[f"optim/{name}/{key}"] = local(value).detach().cpu().contiguous()
        save_file(tensors, str(self._shard_file(directory, self.rank, self.world_size)))
        if self.rank == 0:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            index = {"world_size": self.world_size, "param_groups": groups,
                     "shapes": {n: list(p.shape) for n, p in self.named_params}}
            (directory / SHARD_DIR / "index.json").write_text(json.dumps(index, indent=2))
        dist.barrier()
        return [f"{SHARD_DIR}/"]

    def _load_shards(self, directory: Path) -> None:
        index = json.loads((directory / SHARD_DIR / "index.json").read_text())
        saved_world = int(index["world_size"])
        pieces: dict[str, list[torch.Tensor]] = {}
        if saved_world == self.world_size:
            pieces = {k: [v] for k, v in load_file(str(self._shard_file(directory, self.rank, saved_world))).items()}
        else:  # rebuild each full tensor from every rank's shard (dim-0 chunks), then redistribute
            for r in range(saved_world):
                for k, v in load_file(str(self._shard_file(directory, r, saved_world))).items():
                    pieces.setdefault(k, []).append(v)
        for name, param in self.named_params:
            if f"param/{name}" not in pieces:
                raise ValueError(f"checkpoint {directory} has no shard for parameter '{name}'")
            with torch.no_grad():
                local(param).copy_(self._placed(pieces[f"param/{name}"], param, saved_world))
            state = {}
            for key in OPTIM_KEYS:
                parts = pieces.get(f"optim/{name}/{key}")
                if parts is None:
                    continue
                if key == "step":  # a replicated scalar
                    state[key] = parts[0].clone()
                else:
                    state[key] = self._as_param_layout(self._placed(parts, param, saved_world), param)
            if state:
                self.optimizer.state[param] = state
        for group, saved in zip(self.optimizer.param_groups, index["param_groups"]):
            group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})

    def _placed(self, parts: list[torch.Tensor], param: torch.Tensor, saved_world: int) -> torch.Tensor:
        """This rank's local piece of a parameter-shaped tensor saved as ``parts``."""
        if saved_world == self.world_size or not isinstance(param, DTensor):
            return parts[0] if saved_world == self.world_size else torch.cat(parts, dim=0)
        whole = torch.cat(parts, dim=0).to(param.device)
        return distribute_tensor(whole, param.device_mesh, param.placements).to_local()

    def _as_param_layout(self, piece: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        if isinstance(param, DTensor):
            return DTensor.from_local(piece.to(param.device), param.device_mesh, param.placements,
                                      run_check=False, shape=param.shape, stride=param.stride())
        return piece.to(param.device)
