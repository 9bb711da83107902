"""VeOmni training engine: the trained modules built with VeOmni's parallel state, parallelize API and optimizer.

Setup, on every rank: (1) the process group (gloo on CPU, nccl on CUDA: VeOmni's ``get_dist_comm_backend``
knows no CPU backend, so the engine forms it, as the fsdp2 engine does); (2) ``init_parallel_state`` with
``dp_mode="fsdp2"`` and every rank in the shard dimension; (3) for each trained module (a plain ``nn.Module``:
the diffusers denoiser or the transformers thinker, LoRA layers included; it is in no VeOmni registry)
``build_parallelize_model``: FSDP2 wrap units are the module's ``_no_split_modules`` plus fsdp2's units, passed by
class name (``basic_modules``): the repeated blocks and the submodules the model calls by themselves
(``called_submodules``: a causal LM's output head), each under a class name of its own where it shares one with
modules that are not units (``_unit_classes``); then the root. VeOmni's FSDP2 path always materialises the wrapped model from ``meta`` (``to_empty`` then
``init_weights()``, or a load from a weights directory); our module holds its weights already, so the engine
snapshots its state before wrapping and hands VeOmni an ``init_weights`` that puts each rank's shard of that
snapshot back (parameters and persistent buffers; VeOmni keeps non-persistent ones itself); (4) VeOmni's
``build_optimizer`` (AdamW, one group with the run's weight decay) over the trainable parameters, and VeOmni's
FSDP2 ``clip_grad_norm`` for the step.

The step over ranks and the sharded checkpoint are the core's ``omnirl_core.loop.sharded.ShardedTrainEngine``
(the fsdp2 engine's too), with VeOmni's FSDP2 ``clip_grad_norm``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch.distributed.tensor import DTensor, distribute_tensor

from omnirl_core.config import TrainSection
from omnirl_core.loop.distributed import default_backend, ensure_process_group, shard_units
from omnirl_core.loop.sharded import ShardedTrainEngine, full, local
from omnirl_plugin_veomni.ulysses import UlyssesSwitch, install


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
        False, description="Refused: VeOmni's switch (gradient_checkpointing_enable on transformers-style modules) "
        "does nothing on omnirl's policies, which stay in eval mode (no dropout) while transformers checkpoints only "
        "in training mode. Use the model's model.options.gradient_checkpointing (every model plugin has it)."
    )

    @field_validator("gradient_checkpointing")
    @classmethod
    def _checkpointing_is_the_models(cls, value: bool) -> bool:
        if value:
            raise ValueError("veomni's gradient_checkpointing would do nothing here (omnirl keeps the policy in eval "
                             "mode; transformers checkpoints in training mode only): set "
                             "model.options.gradient_checkpointing=true instead")
        return value

    ulysses_size: int = Field(
        1, ge=1, description="Ulysses sequence-parallel size: the ranks of a group split each sample's tokens and "
        "take the same samples (Qwen-Image: VeOmni's sequence-parallel forward and attention; Wan2.2: a split on "
        "VeOmni's all-to-alls; on during the update only); must divide the world size and the denoiser's attention "
        "heads. 1: off."
    )
    optimizer: Literal["adamw", "anyprecision_adamw"] = Field("adamw", description="VeOmni's optimizer type.")
    shuffle: bool = Field(True, description="Shuffle units (seeded by step) before splitting into minibatches.")


def _restore_into(module: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> Callable[[], None]:
    """An ``init_weights`` for VeOmni's materialisation: each rank's shard of the weights the module held."""

    def init_weights() -> None:
        with torch.no_grad():
            for name, param in module.named_parameters():
                whole = snapshot[name]
                if isinstance(param, DTensor):  # each rank slices its own shard: no communication
                    whole = distribute_tensor(whole.to(param.device), param.device_mesh, param.placements,
                                             src_data_rank=None).to_local()
                local(param).copy_(whole)
            for name, buffer in module.named_buffers():
                if name in snapshot:
                    local(buffer).copy_(snapshot[name])

    return init_weights


def _unit_classes(tree: torch.nn.Module, units: list[torch.nn.Module]) -> set[str]:
    """Class names by which VeOmni (``basic_modules``, matched by name against every module of ``tree``) wraps exactly
    ``units``: a unit's own class name where no other module of ``tree`` has it, else the name of a subclass made for
    the units of that class (a plain ``Linear`` block of a ModuleList, the output head). The subclass adds nothing:
    same methods, same ``isinstance``, same state."""
    chosen = {id(u) for u in units}
    made: dict[type, type] = {}
    names = set()
    for unit in units:
        cls = type(unit)
        if all(id(m) in chosen or type(m).__name__ != cls.__name__ for m in tree.modules()):
            names.add(cls.__name__)
            continue
        if cls not in made:
            made[cls] = type(f"OmnirlUnit{cls.__name__}", (cls,), {"__module__": __name__})
        unit.__class__ = made[cls]
        names.add(made[cls].__name__)
    return names


class VeOmniTrainEngine(ShardedTrainEngine):

    def __init__(self, model: Any, train: TrainSection, options: VeOmniOptions | None, device: Any):
        from veomni.arguments.arguments_types import MixedPrecisionConfig
        from veomni.distributed.parallel_state import init_parallel_state
        from veomni.distributed.torch_parallelize import build_parallelize_model
        from veomni.optim import build_optimizer

        self.model = model
        self.train = train
        self.options = options or VeOmniOptions()
        self.shuffle = self.options.shuffle
        device = torch.device(device)
        ensure_process_group(self.options.backend or default_backend(device.type))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.comm_device = device
        ulysses = self.options.ulysses_size
        if self.world_size % ulysses:
            raise ValueError(f"veomni engine: ulysses_size={ulysses} must divide the {self.world_size} ranks "
                             "(train.options.ulysses_size, run.train_workers)")
        # the FSDP mesh spans the data and sequence ranks (VeOmni's dp_shard_sp): gradients average over all of them
        state = init_parallel_state(dp_size=self.world_size // ulysses, dp_shard_size=self.world_size // ulysses,
                                    dp_mode="fsdp2", device_type=device.type, ulysses_size=ulysses)
        self.switch = UlyssesSwitch()
        if ulysses > 1:  # a sequence-parallel group's ranks take the same samples
            self.data_rank, self.data_size = int(state.dp_rank), self.world_size // ulysses
        mixed = MixedPrecisionConfig(enable=self.options.mixed_precision, param_dtype=self.options.param_dtype,
                                     reduce_dtype=self.options.reduce_dtype)
        modules = model.trained_modules()
        if len(modules) > 1:  # ranks route their samples differently: every module runs in every call
            model.lockstep = True
        self.named_params = []
        called = model.called_submodules()
        for key, module in modules.items():
            if ulysses > 1:
                install(module, self.switch, ulysses)
            kwargs: dict[str, Any] = {"init_device": "meta"}
            if self.world_size == 1:
                # VeOmni wraps nothing without FSDP; on CPU its parallelize refuses a world of one
                # ("Only FSDP training supports `init_device=meta`"): the module trains as it is
                kwargs = {"init_device": device.type} if device.type in ("cuda", "npu", "mlu") else {}
            if kwargs:
                # fsdp2's units: the repeated blocks, and the submodules the model calls by themselves (a causal LM's
                # decoder and output head); VeOmni picks units by class name, so each gets one that names it alone
                units = list(shard_units(module, self.options.shard_modules))
                units += [u for u in called if u is not module and any(u is sub for sub in module.modules())]
                blocks = _unit_classes(module, units)
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
                            mixed_precision=mixed, enable_gradient_checkpointing=False,
                            basic_modules=blocks, **kwargs)
        finally:
            if had:
                module.__dict__["init_weights"] = saved
            else:
                module.__dict__.pop("init_weights", None)
        if wrapped is not module:  # fully_shard works in place; DDP / TP would return another object
            raise RuntimeError(f"VeOmni returned a {type(wrapped).__name__} in place of the module")

    def training(self) -> contextlib.AbstractContextManager[None]:
        return self.switch.on() if self.options.ulysses_size > 1 else contextlib.nullcontext()

    def clip_grad_norm(self) -> float:
        # VeOmni's FSDP2 clipping: the norm over every rank's shards, the same number on every rank
        from veomni.distributed.fsdp2 import clip_grad_norm

        return float(full(clip_grad_norm(self.container, self.train.max_grad_norm)))
