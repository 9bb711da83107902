"""CLIPScore (Hessel et al. 2021, eq. 1): CLIP-S(c, v) = w * max(cos(c, v), 0), w = 2.5.

c is the CLIP text embedding of the caption (the prompt, with the paper's prefix "A photo depicts"), v the
image embedding. Any transformers ``CLIPModel`` checkpoint (the paper uses ViT-B/32).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from omnirl_plugin_clipscore.clip import Clip, load_clip
from omnirl_plugin_clipscore.tiny import tiny_clip_directory

DEFAULT_PATH = "openai/clip-vit-base-patch32"
DEFAULT_PROMPTS = [
    "a red apple on a wooden table",
    "a black cat sitting on a chair",
    "a blue car on a city street",
    "a yellow flower in a green field",
    "a white house under a blue sky",
    "a dog playing with a ball near the sea",
]


class ClipScoreOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(DEFAULT_PATH, description="A transformers CLIPModel checkpoint: a local directory (with its "
                      "processor files) or a hub id.")
    preset: Literal["tiny"] | None = Field(None, description="'tiny': a random-weight CLIP of the same "
                                           "architecture, built once in $OMNIRL_CACHE/presets (ignores path).")
    device: str = Field("auto", description="Device of the CLIP model: auto (cuda if available), cpu, cuda, "
                        "cuda:N.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="CLIP weights' dtype.")
    w: float = Field(2.5, gt=0, description="CLIPScore's rescaling weight w (2.5 in the paper).")
    raw: bool = Field(False, description="Return the raw cosine cos(image, text) in [-1, 1] instead of "
                      "w * max(cos, 0).")
    prefix: str = Field("A photo depicts ", description="Text put before each prompt (the paper's default; "
                        "'' for none).")
    batch_size: int = Field(32, ge=1, description="Images per CLIP forward pass.")


def load_options_clip(options: Any, default_path: str, label: str, tiny_name: str, tiny_act: str,
                      processor_path: str | None = None, split_special_tokens: bool = False) -> Clip:
    """The CLIP a CLIP-based reward's options ask for: the tiny preset's directory, or path (+ processor)."""
    if options.preset == "tiny":
        path, processor_path = str(tiny_clip_directory(tiny_name, tiny_act)), None
    else:
        path = options.path or default_path
    return load_clip(path, processor_path, label=label, device=options.device, dtype=options.dtype,
                     split_special_tokens=split_special_tokens)


def cosine(clip: Clip, outputs: Sequence[Any], texts: Sequence[str], batch_size: int) -> torch.Tensor:
    """cos(image_i, text_i) for each pair, in float32; each distinct text is encoded once."""
    unique = list(dict.fromkeys(texts))
    text = F.normalize(clip.text_embeds(unique), dim=-1)
    index = torch.tensor([unique.index(t) for t in texts], device=text.device)
    image = torch.cat([clip.image_embeds(outputs[i:i + batch_size]) for i in range(0, len(outputs), batch_size)])
    return (F.normalize(image, dim=-1) * text[index]).sum(dim=-1)


class ClipScore:
    def __init__(self, options: ClipScoreOptions | None = None):
        self.options = options or ClipScoreOptions()
        # the paper tokenises with the `clip` package: special-token strings in a caption are plain text
        self.clip = load_options_clip(self.options, DEFAULT_PATH, "CLIPScore (CLIP checkpoint)", "clipscore",
                                      "quick_gelu", split_special_tokens=True)

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str]) -> list[float]:
        cos = cosine(self.clip, outputs, [self.options.prefix + p for p in prompts], self.options.batch_size)
        if self.options.raw:
            return cos.tolist()
        return (self.options.w * cos.clamp(min=0)).tolist()  # Hessel et al. 2021, eq. 1
