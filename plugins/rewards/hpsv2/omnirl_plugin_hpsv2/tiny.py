"""The ``tiny`` preset: a random open_clip checkpoint with ViT-H-14's layout at small sizes, converted with
the same ``convert`` a released HPS checkpoint goes through, and saved with a tiny CLIP processor."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from omnirl_core.presets import atomic_directory, cache_dir
from omnirl_core.rewards_kit.tiny_clip import TINY_VERSION, clip_bpe_tokenizer, tiny_processor
from omnirl_plugin_hpsv2.convert import convert

OPEN_CLIP_FILE = "open_clip.safetensors"
TINY_HEADS = 2


def _blocks(prefix: str, width: int, layers: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    def n(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    out = {}
    for i in range(layers):
        p = f"{prefix}resblocks.{i}."
        out |= {
            f"{p}ln_1.weight": 1 + n(width), f"{p}ln_1.bias": n(width),
            f"{p}attn.in_proj_weight": n(3 * width, width, std=width ** -0.5), f"{p}attn.in_proj_bias": n(3 * width),
            f"{p}attn.out_proj.weight": n(width, width, std=width ** -0.5), f"{p}attn.out_proj.bias": n(width),
            f"{p}ln_2.weight": 1 + n(width), f"{p}ln_2.bias": n(width),
            f"{p}mlp.c_fc.weight": n(4 * width, width, std=width ** -0.5), f"{p}mlp.c_fc.bias": n(4 * width),
            f"{p}mlp.c_proj.weight": n(width, 4 * width, std=(4 * width) ** -0.5), f"{p}mlp.c_proj.bias": n(width),
        }
    return out


def random_open_clip_state(vocab_size: int, seed: int = 0, width: int = 32, layers: int = 2, patch: int = 8,
                           image_size: int = 32, context: int = 77, embed_dim: int = 16) -> dict[str, torch.Tensor]:
    """An open_clip CLIP state dict (keys and shapes of ViT-H-14's, small sizes) with random weights."""
    g = torch.Generator().manual_seed(seed)

    def n(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    grid = image_size // patch
    return {
        "visual.class_embedding": n(width, std=width ** -0.5),
        "visual.positional_embedding": n(grid * grid + 1, width, std=width ** -0.5),
        "visual.conv1.weight": n(width, 3, patch, patch),
        "visual.ln_pre.weight": 1 + n(width), "visual.ln_pre.bias": n(width),
        **_blocks("visual.transformer.", width, layers, g),
        "visual.ln_post.weight": 1 + n(width), "visual.ln_post.bias": n(width),
        "visual.proj": n(width, embed_dim, std=width ** -0.5),
        "token_embedding.weight": n(vocab_size, width),
        "positional_embedding": n(context, width, std=0.01),
        **_blocks("transformer.", width, layers, g),
        "ln_final.weight": 1 + n(width), "ln_final.bias": n(width),
        "text_projection": n(width, embed_dim, std=width ** -0.5),
        "logit_scale": torch.tensor(math.log(1 / 0.07)),
    }


def save_tiny(directory: Path, seed: int = 0) -> None:
    from safetensors.torch import save_file

    tokenizer = clip_bpe_tokenizer()
    state = random_open_clip_state(len(tokenizer), seed)
    save_file(state, str(directory / OPEN_CLIP_FILE))
    convert(directory / OPEN_CLIP_FILE, directory, vision_heads=TINY_HEADS, text_heads=TINY_HEADS)
    tiny_processor(tokenizer).save_pretrained(str(directory))


def tiny_directory(seed: int = 0) -> Path:
    return atomic_directory(cache_dir() / "presets" / f"hpsv2-tiny-v{TINY_VERSION}-seed{seed}",
                            lambda tmp: save_tiny(tmp, seed))
