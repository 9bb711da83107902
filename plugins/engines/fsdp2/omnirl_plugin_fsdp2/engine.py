"""FSDP2 training engine: ``torch.distributed.fsdp.fully_shard`` over the ranks of a process group.

For each trained module (``model.trained_modules()``: the denoiser, or both experts of Wan2.2 A14B) every
block of its top-level ``ModuleList``s is sharded, then the submodules the model calls by themselves
(``model.called_submodules()``: a causal LM's decoder and output head), then the module itself where
parameters are left: parameters (frozen base weights and LoRA adapters alike), gradients and AdamW state live as
DTensor shards, one per rank.

The step over ranks and the sharded checkpoint (``shards/rank-RRRRR-of-WWWWW.safetensors``, loadable on
another number of ranks) are the core's ``omnirl_core.loop.sharded.ShardedTrainEngine``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from omnirl_core.config import TrainSection
from omnirl_core.loop.distributed import default_backend, ensure_process_group, shard_units
from omnirl_core.loop.sharded import ShardedTrainEngine, full


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


class FSDP2TrainEngine(ShardedTrainEngine):

    def __init__(self, model: Any, train: TrainSection, options: FSDP2Options | None, device: Any):
        self.model = model
        self.train = train
        self.options = options or FSDP2Options()
        self.shuffle = self.options.shuffle
        device = torch.device(device)
        ensure_process_group(self.options.backend or default_backend(device.type))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.comm_device = device  # small collectives live where the backend wants them (nccl: CUDA)
        modules = model.trained_modules()
        if len(modules) > 1:  # ranks route their samples differently: every module runs in every call
            model.lockstep = True
        self.named_params = []
        called = model.called_submodules()
        for key, module in modules.items():  # each trained module (Wan2.2 A14B: both experts) sharded alike
            for block in shard_units(module, self.options.shard_modules):
                fully_shard(block, reshard_after_forward=self.options.reshard_after_forward)
            self._shard_called(module, [m for m in called if any(m is sub for sub in module.modules())])
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

    def _shard_called(self, module: torch.nn.Module, called: list[torch.nn.Module]) -> None:
        """The submodules the model calls by themselves (a causal LM's decoder and output head) as units of their
        own, then the module, unless those units hold all of its parameters: a root FSDP module must run forward
        before its units are called alone, and scoring never calls it (generation, through it, still gathers
        every unit)."""
        reshard = self.options.reshard_after_forward
        owners: dict[int, torch.nn.Module] = {}
        for unit in called:
            for param in unit.parameters():
                other = owners.setdefault(id(param), unit)
                if other is not unit:  # e.g. tied input / output embeddings
                    raise NotImplementedError(
                        f"fsdp2 engine: {type(unit).__name__} and {type(other).__name__}, which the model calls by "
                        "themselves, share a parameter (tied embeddings?); FSDP2 units cannot share one")
            fully_shard(unit, reshard_after_forward=reshard)
        covered = {id(p) for unit in called for p in unit.parameters()}
        if not called or any(id(p) not in covered for p in module.parameters()):
            fully_shard(module, reshard_after_forward=reshard)

    def clip_grad_norm(self) -> float:
        # torch's clipping over DTensor gradients all-reduces the norm
        params = [p for _, p in self.named_params]
        return float(full(torch.nn.utils.clip_grad_norm_(params, self.train.max_grad_norm)))
