"""omnirl engine plugin: FSDP2 training over a torch.distributed group (LoRA or full fine-tuning)."""

from omnirl_core import hookimpl
from omnirl_core.registry import EngineSpec


@hookimpl
def omnirl_register_engines(register):
    register(
        EngineSpec(
            name="fsdp2",
            description="FSDP2 (fully_shard) over N ranks: gloo on CPU, nccl on CUDA, hccl on Ascend; sharded "
            "safetensors checkpoints.",
            factory="omnirl_plugin_fsdp2.engine:FSDP2TrainEngine",
            config="omnirl_plugin_fsdp2.engine:FSDP2Options",
            roles=frozenset({"train"}),
            devices=frozenset({"cpu", "cuda", "npu"}),
        )
    )
