"""PickScore (Kirstain et al. 2023): s(x, y) = exp(logit_scale) * cos(E_img(y), E_txt(x)).

PickScore_v1 is a CLIP ViT-H/14 fine-tuned on Pick-a-Pic preferences, loaded as a transformers CLIPModel
with the processor of laion/CLIP-ViT-H-14-laion2B-s32B-b79K, as in the authors' inference script.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field

from omnirl_core.contracts import Reward
from omnirl_core.rewards_kit.clip import cosine, load_options_clip
from omnirl_core.rewards_kit.options import BatchedRewardOptions

DEFAULT_PATH = "yuvalkirstain/PickScore_v1"
DEFAULT_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
DEFAULT_PROMPTS = [
    "a watercolor painting of a fox in a snowy forest",
    "a photo of a red sports car on a mountain road",
    "a cozy cabin by a lake at sunset",
    "a portrait of an astronaut with flowers, oil painting",
    "a bowl of ramen on a wooden table, studio lighting",
    "a castle on a cliff above the sea, fantasy art",
]


class PickScoreOptions(BatchedRewardOptions):
    path: str = Field(DEFAULT_PATH, description="The PickScore CLIPModel: a local directory or a hub id.")
    processor_path: str = Field(DEFAULT_PROCESSOR, description="Its CLIPProcessor (tokenizer + image settings): a "
                                "local directory or a hub id.")


class PickScore(Reward):
    def __init__(self, options: PickScoreOptions | None = None):
        self.options = options or PickScoreOptions()
        self.clip = load_options_clip(self.options, DEFAULT_PATH, "PickScore", "pickscore", "gelu",
                                      processor_path=self.options.processor_path)
        self.scale = float(self.clip.model.logit_scale.detach().float().exp())

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str]) -> list[float]:
        cos = cosine(self.clip, outputs, list(prompts), self.options.batch_size)
        return (self.scale * cos).tolist()  # the authors' script: logit_scale.exp() * text_embs @ image_embs.T
