"""CLIPScore (Hessel et al. 2021, eq. 1): CLIP-S(c, v) = w * max(cos(c, v), 0), w = 2.5.

c is the CLIP text embedding of the caption (the prompt, with the paper's prefix "A photo depicts"), v the
image embedding. Any transformers ``CLIPModel`` checkpoint (the paper uses ViT-B/32).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field

from omnirl_core.contracts import Reward
from omnirl_core.rewards_kit.clip import cosine, load_options_clip
from omnirl_core.rewards_kit.options import BatchedRewardOptions

DEFAULT_PATH = "openai/clip-vit-base-patch32"
DEFAULT_PROMPTS = [
    "a red apple on a wooden table",
    "a black cat sitting on a chair",
    "a blue car on a city street",
    "a yellow flower in a green field",
    "a white house under a blue sky",
    "a dog playing with a ball near the sea",
]


class ClipScoreOptions(BatchedRewardOptions):
    path: str = Field(DEFAULT_PATH, description="A transformers CLIPModel checkpoint: a local directory (with its "
                      "processor files) or a hub id.")
    w: float = Field(2.5, gt=0, description="CLIPScore's rescaling weight w (2.5 in the paper).")
    raw: bool = Field(False, description="Return the raw cosine cos(image, text) in [-1, 1] instead of "
                      "w * max(cos, 0).")
    prefix: str = Field("A photo depicts ", description="Text put before each prompt (the paper's default; "
                        "'' for none).")


class ClipScore(Reward):
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
