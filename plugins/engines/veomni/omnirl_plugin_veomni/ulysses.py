"""Ulysses sequence parallelism on the diffusers denoisers omnirl trains: Qwen-Image (VeOmni's own sequence-parallel
forward and attention) and Wan2.2 (VeOmni's slicing, gathering and all-to-all primitives, with a split of our own:
VeOmni's Wan does its all-to-all only inside its CUDA flash-attention kernels; see ``_WanSplit``).

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
import torch.nn.functional as F


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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on (batch, tokens, heads, dim): interleaved pairs, as diffusers applies it."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class _WanSplit:
    """Wan2.2's sequence split, by hooks on the blocks (diffusers' forward itself is kept): before the first block
    the video tokens are padded to a multiple of the group size and each rank keeps its slice (VeOmni's
    ``slice_input_tensor``); before every block the per-token inputs (RoPE tables; TI2V-5B's per-token timestep
    modulation) are cut alike; after the last block the slices are gathered (VeOmni's ``gather_outputs``: its backward
    sums the group's gradients) and the padding dropped, so the output head sees the whole sequence on every rank."""

    def __init__(self, module: torch.nn.Module, switch: UlyssesSwitch, size: int) -> None:
        self.switch, self.size = switch, size
        self.first, self.last = module.blocks[0], module.blocks[-1]
        self.length = 0  # the video tokens of the current call, before padding

    @staticmethod
    def _group() -> Any:
        from veomni.distributed.parallel_state import get_parallel_state

        return get_parallel_state().sp_group

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        from veomni.distributed.sequence_parallel import slice_input_tensor

        return slice_input_tensor(x, dim=1, padding=True, group=self._group())

    def before(self, block: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not self.switch.active:
            return None
        hidden, text, temb, rope = args
        if block is self.first:
            self.length = hidden.shape[1]
            hidden = self.cut(hidden)
        if temb.ndim == 4:  # TI2V-5B: (batch, tokens, 6, dim)
            temb = self.cut(temb)
        return hidden, text, temb, tuple(self.cut(f) for f in rope)

    def after(self, block: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        if not self.switch.active or block is not self.last:
            return None
        from veomni.distributed.sequence_parallel import gather_outputs

        return gather_outputs(out, gather_dim=1, group=self._group())[:, : self.length]


class _WanSelfAttention:
    """Wan's self-attention (``attn1``) with Ulysses while the switch is on: projections, the norm over all heads and
    RoPE on this rank's tokens, then VeOmni's all-to-all to all tokens and heads / size heads, attention (the padding
    masked out of the keys), and the all-to-all back; the block's own processor otherwise. Cross-attention needs no
    processor of its own: each token attends to the prompt alone."""

    def __init__(self, plain: Any, split: _WanSplit) -> None:
        self.plain, self.split = plain, split

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb: Any = None) -> torch.Tensor:
        if not self.split.switch.active:
            return self.plain(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        from veomni.distributed.parallel_state import get_parallel_state
        from veomni.distributed.sequence_parallel import gather_heads_scatter_seq, gather_seq_scatter_heads

        if encoder_hidden_states is not None or attention_mask is not None or attn.add_k_proj is not None:
            raise NotImplementedError("veomni engine: Ulysses on Wan's self-attention only (no mask, no image "
                                      "context)")
        group = get_parallel_state().ulysses_group
        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            query, key = _rotate(query, *rotary_emb), _rotate(key, *rotary_emb)
        query, key, value = (gather_seq_scatter_heads(t, seq_dim=1, head_dim=2, group=group)
                             for t in (query, key, value))
        mask = None
        if query.shape[1] != self.split.length:  # padded: no token attends to the padding
            mask = (torch.arange(query.shape[1], device=query.device) < self.split.length).view(1, 1, 1, -1)
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                             attn_mask=mask, dropout_p=0.0, is_causal=False).transpose(1, 2)
        out = gather_heads_scatter_seq(out, seq_dim=1, head_dim=2, group=group)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _wan(module: torch.nn.Module, switch: UlyssesSwitch, size: int) -> None:
    heads = int(module.config.num_attention_heads)
    if heads % size:
        raise ValueError(f"veomni engine: ulysses_size={size} must divide the denoiser's {heads} attention heads "
                         "(each rank attends with heads / ulysses_size of them)")
    split = _WanSplit(module, switch, size)
    for block in module.blocks:
        block.register_forward_pre_hook(split.before)
        block.attn1.set_processor(_WanSelfAttention(block.attn1.processor, split))
    split.last.register_forward_hook(split.after)


# the diffusers classes with a sequence-parallel version here, by the name of diffusers' class
_SUPPORTED = {"QwenImageTransformer2DModel": _qwen_image, "WanTransformer3DModel": _wan}


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
