"""LAION aesthetic predictor v2: score = MLP(e / ||e||), e the CLIP ViT-L/14 image embedding.

Prompt-independent; the released head (sac+logos+ava1-l14-linearMSE) predicts a 1-10 rating. CLIP comes
through transformers (openai/clip-vit-large-patch14 = the `clip` package's ViT-L/14), the head from a
safetensors file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from omnirl_core.contracts import Reward
from omnirl_core.presets import atomic_directory, cache_dir
from omnirl_core.rewards_kit.clip import load_clip
from omnirl_core.rewards_kit.options import BatchedRewardOptions
from omnirl_core.rewards_kit.tiny_clip import TINY_VERSION, save_tiny_clip
from omnirl_plugin_aesthetic.mlp import AestheticMLP, load_mlp

DEFAULT_CLIP = "openai/clip-vit-large-patch14"
MLP_FILE = "aesthetic-mlp.safetensors"
DEFAULT_PROMPTS = [
    "a beautiful landscape photograph at golden hour",
    "a detailed oil painting of a garden",
    "a minimalist poster with bold shapes",
    "a portrait photo with soft studio light",
]


class AestheticOptions(BatchedRewardOptions):
    clip_path: str = Field(DEFAULT_CLIP, description="The CLIP ViT-L/14 checkpoint (transformers CLIPModel): a "
                           "local directory or a hub id.")
    mlp_path: str | None = Field(None, description="The predictor head as .safetensors (convert the released "
                                 ".pth once: python -m omnirl_plugin_aesthetic.convert IN.pth OUT.safetensors).")


def save_tiny(directory: Path, seed: int = 0) -> None:
    """A tiny ViT-L/14-style CLIP (quick_gelu) and a random head of the released layout on its embedding."""
    from safetensors.torch import save_file

    save_tiny_clip(directory, "quick_gelu", seed)
    from transformers import CLIPConfig

    dim = CLIPConfig.from_pretrained(str(directory)).projection_dim
    torch.manual_seed(seed + 1)
    save_file({k: v.contiguous() for k, v in AestheticMLP(dim).state_dict().items()}, str(directory / MLP_FILE))


def tiny_directory(seed: int = 0) -> Path:
    return atomic_directory(cache_dir() / "presets" / f"aesthetic-tiny-v{TINY_VERSION}-seed{seed}",
                            lambda tmp: save_tiny(tmp, seed))


class AestheticScore(Reward):
    def __init__(self, options: AestheticOptions | None = None):
        self.options = o = options or AestheticOptions()
        clip_path, mlp_path = o.clip_path, o.mlp_path
        if o.preset == "tiny":
            directory = tiny_directory()
            clip_path, mlp_path = str(directory), str(directory / MLP_FILE)
        self.mlp = load_mlp(mlp_path)  # first: its error is the likelier one and needs no download
        self.clip = load_clip(clip_path, None, label="Aesthetic predictor (CLIP ViT-L/14)", device=o.device,
                              dtype=o.dtype, option="clip_path")
        self.mlp.to(self.clip.device)

    @torch.no_grad()
    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str]) -> list[float]:
        size = self.options.batch_size
        emb = torch.cat([self.clip.image_embeds(outputs[i:i + size]) for i in range(0, len(outputs), size)])
        return self.mlp(F.normalize(emb, dim=-1)).squeeze(-1).tolist()
