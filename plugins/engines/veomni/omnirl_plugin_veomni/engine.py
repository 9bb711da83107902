"""VeOmni training engine: the trained modules built with VeOmni's parallel state, parallelize API and optimizer.

Setup, on every rank: (1) the process group (gloo on CPU, nccl on CUDA: VeOmni's ``get_dist_comm_backend``
knows no CPU backend, so the engine forms it, as the fsdp2 engine does); (2) ``init_parallel_state`` with
``dp_mode="fsdp2"`` and every rank in the shard dimension; (3) for each trained module (a plain ``nn.Module``:
the diffusers denoiser, LoRA layers included; it is in no VeOmni registry) ``build_parallelize_model``: FSDP2
wrap units are the module's ``_no_split_modules`` plus the classes of its repeated blocks (``basic_modules``),
then the root. VeOmni's FSDP2 path always materialises the wrapped model from ``meta`` (``to_empty`` then
``init_weights()``, or a load from a weights directory); our module holds its weights already, so the engine
snapshots its state before wrapping and hands VeOmni an ``init_weights`` that puts each rank's shard of that
snapshot back (parameters and persistent buffers; VeOmni keeps non-persistent ones itself); (4) VeOmni's
``build_optimizer`` (AdamW, one group with the run's weight decay) over the trainable parameters, and VeOmni's
FSDP2 ``clip_grad_norm`` for the step.

One training step is the fsdp2 engine's (and so the single-process torch engine's): ``prepare_all`` on every
rank, minibatches of whole samples, each rank its ``rank_share`` in the same number of micro-batches as the
busiest rank, agreed rollout-correction fix-ups, the loss scaled by the world size (FSDP averages gradients),
``finite_update``, ``after_optimizer_step``.

Checkpoints: ``shards/rank-RRRRR-of-WWWWW.safetensors`` (each rank's parameter and AdamW shards),
``shards/index.json``, and on rank 0 the gathered trained weights in the model's own layout. No pickle.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file
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


class VeOmniOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: str | None = Field(
        None, description="torch.distributed backend when the engine forms its own group; None: the device "
        "type's default (gloo on CPU, nccl on CUDA)."
    )
    shard_modules: list[str] | None = Field(
        None, description="Dotted paths of the denoiser's ModuleLists whose block classes VeOmni wraps one by one "
        "(basic_modules); None: every top-level ModuleList, else the outermost ones."
    )
    reshard_after_forward: bool = Field(True, description="Free gathered parameters after each forward.")
    mixed_precision: bool = Field(
        False, description="VeOmni's FSDP2 mixed precision: fp32 master weights, unsharded parameters in "
        "param_dtype for compute, gradients reduced in reduce_dtype. Off: everything in the model's dtype."
    )
    param_dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="Compute dtype with "
                                                                   "mixed_precision.")
    reduce_dtype: Literal["bfloat16", "float16", "float32"] = Field("float32", description="Gradient reduction "
                                                                    "dtype with mixed_precision.")
    gradient_checkpointing: bool = Field(
        False, description="VeOmni's gradient checkpointing (gradient_checkpointing_enable, transformers-style "
        "modules only); a diffusers denoiser checkpoints through the model's own option "
        "(model.options.gradient_checkpointing)."
    )
    ulysses_size: int = Field(
        1, ge=1, description="Ulysses sequence-parallel size. Only 1: the plain modules omnirl trains do not call "
        "VeOmni's sequence-parallel attention (only VeOmni's own model classes do)."
    )
    optimizer: Literal["adamw", "anyprecision_adamw"] = Field("adamw", description="VeOmni's optimizer type.")
    shuffle: bool = Field(True, description="Shuffle units (seeded by step) before splitting into minibatches.")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _restore_into(module: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> Callable[[], None]:
    """An ``init_weights`` for VeOmni's materialisation: each rank's shard of the weights the module held."""

    def init_weights() -> None:
        with torch.no_grad():
            for name, param in module.named_parameters():
                full = snapshot[name]
                if isinstance(param, DTensor):  # each rank slices its own shard: no communication
                    full = distribute_tensor(full.to(param.device), param.device_mesh, param.placements,
                                             src_data_rank=None).to_local()
                _local(param).copy_(full)
            for name, buffer in module.named_buffers():
                if name in snapshot:
                    _local(buffer).copy_(snapshot[name])

    return init_weights


class VeOmniTrainEngine(TrainEngine):
    distributed = True

    def __init__(self, model: Any, train: TrainSection, options: VeOmniOptions | None, device: Any):
        from veomni.arguments.arguments_types import MixedPrecisionConfig
        from veomni.distributed.parallel_state import init_parallel_state
        from veomni.distributed.torch_parallelize import build_parallelize_model
        from veomni.optim import build_optimizer

        self.model = model
        self.train = train
        self.options = options or VeOmniOptions()
        if self.options.ulysses_size != 1:
            raise NotImplementedError(
                "veomni engine: ulysses_size > 1 needs a model that calls VeOmni's sequence-parallel attention "
                "(VeOmni's own model classes); omnirl's denoisers are plain diffusers modules.")
        device = torch.device(device)
        ensure_process_group(self.options.backend or default_backend(device.type))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.comm_device = device
        init_parallel_state(dp_size=self.world_size, dp_shard_size=self.world_size, dp_mode="fsdp2",
                            device_type=device.type, ulysses_size=1)
        mixed = MixedPrecisionConfig(enable=self.options.mixed_precision, param_dtype=self.options.param_dtype,
                                     reduce_dtype=self.options.reduce_dtype)
        modules = model.trained_modules()
        if len(modules) > 1:  # ranks route their samples differently: every module runs in every call
            model.lockstep = True
        self.named_params = []
        for key, module in modules.items():
            blocks = {type(b).__name__ for b in shard_units(module, self.options.shard_modules)}
            kwargs: dict[str, Any] = {"init_device": "meta"}
            if self.world_size == 1:
                # VeOmni wraps nothing without FSDP; on CPU its parallelize refuses a world of one
                # ("Only FSDP training supports `init_device=meta`"): the module trains as it is
                kwargs = {"init_device": device.type} if device.type in ("cuda", "npu", "mlu") else {}
            if kwargs:
                self._parallelize(build_parallelize_model, module, sorted(blocks), mixed, kwargs)
            for method in getattr(module, "fsdp_forward_methods", ()):  # BAGEL's prompt_kv
                from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

                if isinstance(module, FSDPModule):
                    register_fsdp_forward_method(module, method)
            prefix = f"{key}." if len(modules) > 1 else ""  # one module: the names of earlier checkpoints
            self.named_params += [(prefix + n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not self.named_params:
            raise ValueError("the model has no trainable parameters (LoRA not added / everything frozen)")
        # one container: VeOmni's optimizer and FSDP2 grad clipping see every trained module at once
        self.container = torch.nn.ModuleDict(modules)
        self.optimizer = build_optimizer(self.container, lr=train.lr, betas=tuple(train.betas),
                                         weight_decay=train.weight_decay, optimizer_type=self.options.optimizer)

    def _parallelize(self, build: Callable[..., Any], module: torch.nn.Module, blocks: list[str],
                     mixed: Any, kwargs: dict[str, Any]) -> None:
        snapshot = {k: v.detach().clone() for k, v in module.state_dict().items()}
        had = "init_weights" in module.__dict__
        saved = module.__dict__.get("init_weights")
        module.__dict__["init_weights"] = _restore_into(module, snapshot)  # shadows any class method
        try:
            wrapped = build(module, weights_path=None, enable_reshard_after_forward=self.options.reshard_after_forward,
                            mixed_precision=mixed, enable_gradient_checkpointing=self.options.gradient_checkpointing,
                            basic_modules=blocks, **kwargs)
        finally:
            if had:
                module.__dict__["init_weights"] = saved
            else:
                module.__dict__.pop("init_weights", None)
        if wrapped is not module:  # fully_shard works in place; DDP / TP would return another object
            raise RuntimeError(f"VeOmni returned a {type(wrapped).__name__} in place of the module")

    # -- update --------------------------------------------------------------------------------
    def update(self, algorithm: Any, units: list[Any], step: int,
               reference: Callable[[], list[dict[str, Any]]] | None = None) -> dict[str, float]:
        """One training step; ``reference``: a separate reference worker's outputs (``training.prepare_all``)."""
        from veomni.distributed.fsdp2 import clip_grad_norm

        metrics = MetricMean()
        mbs = self.train.micro_batch_size
        prepare_all(algorithm, self.model, units, mbs, metrics, reference)
        for index, minibatch in enumerate(minibatches(units, self.train.minibatches, step, self.options.shuffle)):
            self.optimizer.zero_grad(set_to_none=True)
            mine = rank_share(minibatch, self.rank, self.world_size)
            # every rank runs as many micro-batches as the busiest one: FSDP's collectives must pair up
            busiest = max(len(rank_share(minibatch, r, self.world_size)) for r in range(self.world_size))
            for micro in split_even(mine, -(-busiest // mbs)):
                loss, m = self._backward(algorithm, micro, minibatch, first_update=index == 0)
                metrics.add({"loss": float(loss.detach()), **m}, len(micro))  # an empty share: names only
            fix = rs_corrections(algorithm, mine, metrics, filler=minibatch[:1])
            count = torch.tensor([-(-len(fix) // mbs)], dtype=torch.int64, device=self.comm_device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            for micro in split_even(fix, int(count.item())):
                self._backward(algorithm, micro, minibatch, correction=True)
            # VeOmni's FSDP2 clipping: the norm over every rank's shards, the same decision on every rank
            grad_norm = float(_full(clip_grad_norm(self.container, self.train.max_grad_norm)))
            if finite_update(grad_norm, [], step, index, self.train.nonfinite, metrics):
                metrics.add({"grad_norm": grad_norm}, 1.0 / self.world_size)
                self.optimizer.step()
                algorithm.after_optimizer_step(self.model)  # e.g. FlowGRPO's EMA of the weights
            self.optimizer.zero_grad(set_to_none=True)
        metrics.all_reduce(self.comm_device)
        return metrics.result()

    def _backward(self, algorithm: Any, micro: list[Any], minibatch: list[Any], **kwargs: Any):
        loss, m = algorithm.loss(self.model, micro or minibatch[:1], **kwargs)
        # FSDP averages gradients over ranks: scale by the world size so they sum, like one process
        (loss * (len(micro) / len(minibatch) * self.world_size)).backward()
        return loss, m

    # -- weights for sync and export -----------------------------------------------------------
    def trained_state(self) -> dict[str, torch.Tensor]:
        """The trained weights as full CPU tensors (LoRA only when training LoRA). Collective."""
        return {k: _full(v).detach().cpu().contiguous() for k, v in self.model.trained_state_dict().items()}

    # -- sharded checkpoints (the fsdp2 engine's layout) ---------------------------------------
    def _shard_file(self, directory: Path, rank: int, world: int) -> Path:
        return directory / SHARD_DIR / f"rank-{rank:05d}-of-{world:05d}.safetensors"

    def save_state(self, directory: Path, rank: int) -> list[str]:
        """Every rank writes its shard of the parameters and optimizer state; rank 0 also writes the gathered
        trained weights in the model's own layout. Collective."""
        files = self._save_shards(Path(directory))
        full = self.trained_state()
        if rank == 0:
            files += self.model.save_trained(directory, state=full)
        return files

    def load_state(self, directory: Path) -> None:
        self._load_shards(Path(directory))

    def _save_shards(self, directory: Path) -> list[str]:
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
