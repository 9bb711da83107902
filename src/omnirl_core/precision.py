"""The precision and placement policy every model shares.

- Weights: ``model.dtype: auto`` is bfloat16 on an accelerator and float32 on the CPU.
- Sampler math and log-probs are float32 whatever the weights (the core's sampler casts).
- LoRA adapters keep a float32 master copy (``upcast_adapters``): the optimizer's updates, often below bfloat16's
  resolution at a LoRA learning rate, are not rounded away; peft runs the adapter branch in the adapter's dtype
  and casts its sum back to the layer's. Full fine-tuning keeps the model dtype (as the engines hold it).
- ``model.offload: cpu`` (``offload_frozen``): the frozen components used only around the trained network (text
  encoders, VAE) live in host memory and visit the device only while they run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def concrete_dtype(name: str, device_type: str) -> str:
    """``auto`` -> bfloat16 on an accelerator, float32 on the CPU; anything else as given."""
    if name != "auto":
        return name
    return "float32" if device_type == "cpu" else "bfloat16"


def upcast_adapters(params: Iterable[torch.nn.Parameter]) -> int:
    """Cast trainable 16-bit parameters (LoRA adapters) to float32 in place; returns how many were cast."""
    import torch

    cast = 0
    for p in params:
        if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16):
            p.data = p.data.float()
            cast += 1
    return cast


def offload_frozen(modules: Iterable[torch.nn.Module], device: torch.device | str) -> None:
    """Keep each module in host memory and move it to ``device`` only for its own forward calls (and back after).

    Hooks go on every direct child with parameters, not only the module itself: a VAE's ``decode`` calls its
    decoder and post-quantisation layers, never the VAE's own ``forward``."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return

    def to_device(module: torch.nn.Module, _args: object) -> None:
        module.to(device)

    def to_host(module: torch.nn.Module, _args: object, _output: object) -> None:
        module.to("cpu")

    for module in modules:
        module.to("cpu")
        children = [c for c in module.children() if any(True for _ in c.parameters())]
        for target in [module, *children]:
            target.register_forward_pre_hook(to_device)
            target.register_forward_hook(to_host)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
