"""omnirl engine plugin: single-process PyTorch training (LoRA or full fine-tuning)."""

from omnirl_core import hookimpl
from omnirl_core.registry import EngineSpec


@hookimpl
def omnirl_register_engines(register):
    register(
        EngineSpec(
            name="torch",
            description="Single-process training: AdamW, gradient accumulation over micro-batches, clipping.",
            factory="omnirl_plugin_torch.engine:TorchTrainEngine",
            config="omnirl_plugin_torch.engine:TorchTrainOptions",
            roles=frozenset({"train"}),
            devices=frozenset({"cpu", "cuda", "npu"}),
        )
    )
