"""FSDP2 training engine: ``torch.distributed.fsdp.fully_shard`` over the ranks of a process group.

For each trained module (``model.trained_modules()``: the denoiser, or both experts of Wan2.2 A14B) every
block of its top-level ``ModuleList``s is sharded, then the module itself: parameters (frozen base
weights and LoRA adapters alike), gradients and AdamW state live as DTensor shards, one per rank.

One training step, on every rank: (1) ``algorithm.prepare`` over every unit without grad (each rank
computes the same old log-probs and reference outputs, so no gather is needed); (2) the units are
shuffled by sample (seeded by step) and split into ``minibatches``; each rank takes every world-th sample
(whole, with all its trained steps) of a minibatch and runs the same number of micro-batches as its peers (collectives must match); the loss is
scaled so that the reduced gradient equals the single-process engine's, then one optimizer step.

Checkpoints are sharded safetensors: ``shards/rank-RRRRR-of-WWWWW.safetensors`` holds each rank's local
shards of the trainable parameters and their AdamW state; ``shards/index.json`` the world size, shapes
and optimizer hyperparameters. They load back on the same or another number of ranks (the full tensor is
rebuilt from the shards, then redistributed). No pickle.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from omnirl_core.config import TrainSection
from omnirl_core.contracts import TrainEngine
from omnirl_core.loop.distributed import default_backend, ensure_process_group, shard_units
from omnirl_core.loop.training import (
    MetricMean,
    finite_update,
    minibatches,
    prepare_all,
    rank_share,
    rs_corrections,
    split_even,
)

SHARD_DIR = "shards"
OPTIM_KEYS = ("exp_avg", "exp_avg_sq", "step")


class FSDP2Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: str | None = Field(
        None, description="torch.distributed backend when the engine forms its own group; None: the device "
        "type's default (gloo on CPU, nccl on CUDA, hccl with torch-npu)."
    )
    shard_modules: list[str] | None = Field(
        None, description="Dotted paths of the denoiser's ModuleLists holding the blocks to shard one by one; "
        "None: every top-level ModuleList, else the outermost ModuleLists (e.g. language_model.model.layers)."
    )
    reshard_after_forward: bool = Field(True, description="Free gathered parameters after each forward (less "
                                        "memory, one more all-gather in backward).")
    shuffle: bool = Field(True, description="Shuffle units (seeded by step) before splitting into minibatches.")


def _blocks(denoiser: torch.nn.Module, names: list[str] | None) -> list[torch.nn.Module]:
    return shard_units(denoiser, names)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class FSDP2TrainEngine(TrainEngine):
    distributed = True

    def __init__(self, model: Any, train: TrainSection, options: FSDP2Options | None, device: Any):
        self.model = model
        self.train = train
        self.options = options or FSDP2Options()
        device = torch.device(device)
        ensure_process_group(self.options.backend or default_backend(device.type))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.comm_device = device  # small collectives live where the backend wants them (nccl: CUDA)
        modules = model.trained_modules()
        if len(modules) > 1:  # ranks route their samples differently: every module runs in every call
            model.lockstep = True
        self.named_params = []
        for key, module in modules.items():  # each trained module (Wan2.2 A14B: both experts) sharded alike
            for block in _blocks(module, self.options.shard_modules):
                fully_shard(block, reshard_after_forward=self.options.reshard_after_forward)
            fully_shard(module, reshard_after_forward=self.options.reshard_after_forward)
            # methods a model calls instead of forward (BAGEL's prompt_kv) gather the root's parameters too
            for method in getattr(module, "fsdp_forward_methods", ()):
                register_fsdp_forward_method(module, method)
            prefix = f"{key}." if len(modules) > 1 else ""  # one module: the names of earlier checkpoints
            self.named_params += [(prefix + n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not self.named_params:
            raise ValueError("the model has no trainable parameters (LoRA not added / everything frozen)")
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self.named_params], lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay
        )

    # -- update --------------------------------------------------------------------------------
    def update(self, algorithm: Any, units: list[Any], step: int,
               reference: Callable[[], list[dict[str, Any]]] | None = None) -> dict[str, float]:
        """One training step; ``reference``: a separate reference worker's outputs (``training.prepare_all``)."""
        metrics = MetricMean()
        mbs = self.train.micro_batch_size
        prepare_all(algorithm, self.model, units, mbs, metrics, reference)
        params = [p for _, p in self.named_params]
        for index, minibatch in enumerate(minibatches(units, self.train.minibatches, step, self.options.shuffle)):
            self.optimizer.zero_grad(set_to_none=True)
            mine = rank_share(minibatch, self.rank, self.world_size)
            # every rank runs as many micro-batches as the busiest one: FSDP's collectives must pair up
            busiest = max(len(rank_share(minibatch, r, self.world_size)) for r in range(self.world_size))
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
            grad_norm = float(_full(torch.nn.utils.clip_grad_norm_(params, self.train.max_grad_norm)))
            if finite_update(grad_norm, [], step, index, self.train.nonfinite, metrics):
                metrics.add({"grad_norm": grad_norm}, 1.0 / self.world_size)
                self.optimizer.step()
                algorithm.after_optimizer_step(self.model)  # e.g. FlowGRPO's EMA of the weights
            self.optimizer.zero_grad(set_to_none=True)
        metrics.all_reduce(self.comm_device)
        return metrics.result()

    def _backward(self, algorithm: Any, micro: list[Any], minibatch: list[Any], **kwargs: Any):
        # an empty share still joins the collectives, with a zero-weight forward/backward
        loss, m = algorithm.loss(self.model, micro or minibatch[:1], **kwargs)
        # FSDP averages gradients over ranks: scale by the world size so they sum, like one process
        (loss * (len(micro) / len(minibatch) * self.world_size)).backward()
        return loss, m

    # -- weights for sync and export -----------------------------------------------------------
    def trained_state(self) -> dict[str, torch.Tensor]:
        """The trained weights as full CPU tensors (LoRA only when training LoRA). Collective: every rank
        calls it."""
        return {k: _full(v).detach().cpu().contiguous() for k, v in self.model.trained_state_dict().items()}

    # -- sharded checkpoints -------------------------------------------------------------------
    def _shard_file(self, directory: Path, rank: int, world: int) -> Path:
        return directory / SHARD_DIR / f"rank-{rank:05d}-of-{world:05d}.safetensors"

    def save_state(self, directory: Path, rank: int) -> list[str]:
        """Every rank writes its shard of the parameters and optimizer state; rank 0 also writes the gathered
        trained weights in the model's own layout (what diffusers / peft read). Collective."""
        files = self._save_shards(directory)
        full = self.trained_state()  # a collective: every rank
        if rank == 0:
            files += self.model.save_trained(directory, state=full)
        return files

    def load_state(self, directory: Path) -> None:
        """Each rank's shards (resharded when the checkpoint has another world size)."""
        self._load_shards(directory)

    def _save_shards(self, directory: str | Path) -> list[str]:
        directory = Path(directory)
        (directory / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        for name, param in self.named_params:
            tensors[f"param/{name}"] = _local(param.detach()).cpu().contiguous()
            for key, value in self.optimizer.state.get(param, {}).items():
                if torch.is_tensor(value):
                    tensors[f"optim/{name}/{key}"] = _local(value).detach().cpu().contiguous()
        save_file(tensors, str(self._shard_file(directory, self.rank, self.world_size)))
        if self.rank == 0:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            index = {"world_size": self.world_size, "param_groups": groups,
                     "shapes": {n: list(p.shape) for n, p in self.named_params}}
            (directory / SHARD_DIR / "index.json").write_text(json.dumps(index, indent=2))
        dist.barrier()
        return [f"{SHARD_DIR}/"]

    def _load_shards(self, directory: str | Path) -> None:
        directory = Path(directory)
        index = json.loads((directory / SHARD_DIR / "index.json").read_text())
        saved_world = int(index["world_size"])
        if saved_world == self.world_size:
            local = load_file(str(self._shard_file(directory, self.rank, saved_world)))
            pieces = {k: [v] for k, v in local.items()}
        else:  # rebuild each full tensor from every rank's shard (dim-0 chunks), then redistribute
            pieces: dict[str, list[torch.Tensor]] = {}
            for r in range(saved_world):
                for k, v in load_file(str(self._shard_file(directory, r, saved_world))).items():
                    pieces.setdefault(k, []).append(v)
        for name, param in self.named_params:
            if f"param/{name}" not in pieces:
                raise ValueError(f"checkpoint {directory} has no shard for parameter '{name}'")
            with torch.no_grad():
                _local(param).copy_(self._placed(pieces[f"param/{name}"], param, saved_world))
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
        full = torch.cat(parts, dim=0).to(param.device)
        return distribute_tensor(full, param.device_mesh, param.placements).to_local()

    def _as_param_layout(self, local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        if isinstance(param, DTensor):
            return DTensor.from_local(local.to(param.device), param.device_mesh, param.placements,
                                      run_check=False, shape=param.shape, stride=param.stride())
        return local.to(param.device)
