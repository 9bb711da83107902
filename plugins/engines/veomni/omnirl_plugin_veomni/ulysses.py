"""Ulysses sequence parallelism on the denoisers VeOmni has a sequence-parallel version of.

VeOmni's Qwen-Image (``veomni.models.diffusers.qwen_image``) is the diffusers ``QwenImageTransformer2DModel`` with two
pieces swapped in: its forward pads the image and text streams to a multiple of the group size and gives each rank
its slice of both (RoPE tables and the joint attention mask stay whole), and gathers the image stream back before the
output head, so every rank of the group holds the whole prediction; ``QwenImageSPAttnProcessor`` runs each block's
joint attention after an all-to-all that trades the sequence split for a head split (each rank attends over the whole
sequence with ``heads / size`` heads), then the inverse all-to-all. The gather's backward sums the ranks' gradients,
so each rank's block gradients are ``size`` times its rows' share, and their mean over the FSDP mesh (which includes
the sequence ranks) is the whole gradient.

omnirl trains diffusers' class itself (built by the model plugin, LoRA layers injected by peft), so the engine puts
VeOmni's two pieces on that instance: a forward and a processor per block that dispatch to VeOmni's while the update
runs (``UlyssesSwitch.on``) and to the module's own otherwise. Outside the update (a colocated rollout, a log-prob
check) the ranks may hold different samples, which a sequence split would mix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class UlyssesSwitch:
    """Whether the sequence-parallel forward is on (during the engine's update only)."""

    def __init__(self) -> None:
        self.active = False

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False


class _SwitchedQwenImageProcessor:
    """VeOmni's sequence-parallel joint attention while the switch is on, the block's own processor otherwise.

    The call signature is the processors' (diffusers passes only the keywords a processor's ``__call__`` names)."""

    def __init__(self, parallel: Any, plain: Any, switch: UlyssesSwitch) -> None:
        self.parallel, self.plain, self.switch = parallel, plain, switch

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 encoder_hidden_states_mask: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: Any = None) -> Any:
        processor = self.parallel if self.switch.active else self.plain
        return processor(attn, hidden_states, encoder_hidden_states=encoder_hidden_states,
                         encoder_hidden_states_mask=encoder_hidden_states_mask, attention_mask=attention_mask,
                         image_rotary_emb=image_rotary_emb)


def _qwen_image(module: torch.nn.Module, switch: UlyssesSwitch, size: int) -> None:
    from veomni.models.diffusers.qwen_image.qwen_image_transformer import (
        modeling_qwen_image_transformer as sp,
    )

    heads = int(module.config.num_attention_heads)
    if heads % size:
        raise ValueError(f"veomni engine: ulysses_size={size} must divide the denoiser's {heads} attention heads "
                         "(each rank attends with heads / ulysses_size of them)")
    parallel = sp.QwenImageSPAttnProcessor()
    for block in module.transformer_blocks:
        block.attn.set_processor(_SwitchedQwenImageProcessor(parallel, block.attn.processor, switch))
    plain = type(module).forward
    split = sp.QwenImageTransformer2DModel_forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return (split if switch.active else plain)(module, *args, **kwargs)

    module.forward = forward  # the instance's: FSDP2's hooks run around it as around the class's


# the diffusers classes VeOmni has a sequence-parallel version of, by the name of diffusers' class
_SUPPORTED = {"QwenImageTransformer2DModel": _qwen_image}


def supported_class(module: torch.nn.Module) -> str | None:
    """The diffusers class of ``module`` that has a sequence-parallel version here (its subclasses count: FSDP2 and
    peft keep the class as a base), or None."""
    for cls in type(module).__mro__:
        if cls.__name__ in _SUPPORTED and cls.__module__.startswith("diffusers."):
            return cls.__name__
    return None


def install(module: torch.nn.Module, switch: UlyssesSwitch, size: int) -> None:
    """Put VeOmni's sequence-parallel forward and attention on ``module`` (switched by ``switch``), or say why not."""
    name = supported_class(module)
    if name is None:
        raise NotImplementedError(
            f"veomni engine: ulysses_size={size}: no sequence-parallel version of {type(module).__name__} (VeOmni "
            f"has one for diffusers' {', '.join(sorted(_SUPPORTED))}); train it with ulysses_size=1")
    _SUPPORTED[name](module, switch, size)
