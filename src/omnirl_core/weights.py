"""Weight sync actor -> rollout after each update.

What moves: only the LoRA weights when a LoRA adapter is trained (the frozen base is already on both
sides), the full denoiser state otherwise, and nothing when actor and rollout share one model
(colocated). A sharded train engine gathers full tensors first (``TrainEngine.trained_state``; every rank
takes part, rank 0 sends).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from omnirl_core.contracts import PolicyModel, TrainEngine


def cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A detached, contiguous CPU tensor that shares no storage with ``tensor``: an exported state must not
    change when the live parameters do (a swap restored after the export, the next update). Copies once."""
    out = tensor.detach().cpu()
    if out.data_ptr() == tensor.data_ptr():  # already on the CPU: .cpu() returned the same storage
        out = out.clone()
    return out.contiguous()


def export_trained_state(model: PolicyModel, trainer: TrainEngine | None = None) -> dict[str, torch.Tensor]:
    """The trained weights as plain CPU tensors: LoRA only (peft names) when training LoRA, else full. With a
    train engine, its ``trained_state`` (a sharded engine gathers: a collective)."""
    return trainer.trained_state() if trainer is not None else model.trained_state_dict()


def import_trained_state(model: PolicyModel, state: dict[str, torch.Tensor]) -> None:
    model.load_trained_state_dict(state)


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def checkpoint_names(module: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``module``'s state (its attribute names) in the names and layout of its checkpoint files, the names
    a serving engine's loaders expect: transformers renames and fuses some weights at load time (e.g. the MoE
    experts); its own reverse of that is what ``save_pretrained`` writes."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5: state names are checkpoint names
        return state
    return dict(revert_weight_conversion(module, dict(state)))


def merged_weights(module: torch.nn.Module, adapted_only: bool = False) -> dict[str, torch.Tensor]:
    """``module``'s weights with every peft LoRA adapter merged in (base + scale B A), under the names the
    module has without peft (``x.base_layer.weight`` -> ``x.weight``; no ``lora_`` tensors): what a serving
    engine that knows nothing of LoRA loads. ``adapted_only``: just the layers an adapter changes."""
    import torch

    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, layer in module.named_modules():
            base = getattr(layer, "base_layer", None)
            if base is not None and hasattr(layer, "get_delta_weight"):
                weight = base.weight.detach().clone()
                for adapter in getattr(layer, "active_adapters", []):
                    weight += layer.get_delta_weight(adapter).to(weight.dtype)
                out[f"{name}.weight"] = weight
                if getattr(base, "bias", None) is not None:
                    out[f"{name}.bias"] = base.bias.detach()
        if not adapted_only:
            for key, value in module.state_dict().items():
                if "lora_" in key or ".base_layer." in key:
                    continue
                out.setdefault(key, value.detach())
    return out
