"""``temporal-consistency``: how little a video changes from frame to frame, in CLIP's image space.

score(video) = 1/(T-1) * sum_{t=1}^{T-1} cos(E(f_t), E(f_{t-1})), over the frames 0, s, 2s, ... (stride s),
E the CLIP image embedding. 1 for a still video; VBench's background-consistency dimension measures the
same quantity on CLIP features (it also averages in each frame's similarity to the first; ``anchor_weight``).
Prompt-independent: pair it with a prompt reward (``video-frames`` over clipscore / pickscore), or it rewards
frozen videos.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from omnirl_core.contracts import Reward
from omnirl_core.rewards_kit.clip import load_options_clip
from omnirl_core.rewards_kit.options import BatchedRewardOptions

DEFAULT_PATH = "openai/clip-vit-base-patch32"
DEFAULT_PROMPTS = [
    "a slow pan across a mountain landscape",
    "a sailboat drifting on a calm lake",
    "clouds moving over a city skyline",
    "a candle flame flickering in a dark room",
]


class TemporalOptions(BatchedRewardOptions):
    path: str = Field(DEFAULT_PATH, description="A transformers CLIPModel checkpoint (local directory or hub id) "
                      "whose image embeddings are compared.")
    stride: int = Field(1, ge=1, description="Compare every stride-th frame (0, s, 2s, ...).")
    anchor_weight: float = Field(0.0, ge=0, le=1, description="Weight of each frame's similarity to the first "
                                 "frame (VBench averages both: 0.5); 0: consecutive frames only.")
    batch_size: int = Field(64, ge=1, description="Frames per CLIP forward pass.")


def consistency(embeds: torch.Tensor, anchor_weight: float = 0.0) -> float:
    """(T, D) frame embeddings -> mean over t >= 1 of (1-a) cos(e_t, e_{t-1}) + a cos(e_t, e_0)."""
    if embeds.shape[0] < 2:
        return 1.0
    e = F.normalize(embeds.float(), dim=-1)
    consecutive = (e[1:] * e[:-1]).sum(-1)
    to_first = e[1:] @ e[0]
    return float(((1 - anchor_weight) * consecutive + anchor_weight * to_first).mean())


class TemporalConsistency(Reward):
    def __init__(self, options: TemporalOptions | None = None):
        self.options = o = options or TemporalOptions()
        self.clip = load_options_clip(o, DEFAULT_PATH, "temporal-consistency (CLIP checkpoint)",
                                      "temporal-consistency", "quick_gelu")

    @torch.no_grad()
    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str]) -> list[float]:
        frames, counts = [], []
        for video in outputs:
            if video.dim() != 4 or video.shape[0] != 3:
                raise ValueError(f"temporal-consistency: expected a video (3, F, H, W), got {tuple(video.shape)}")
            picked = [video[:, t] for t in range(0, video.shape[1], self.options.stride)]
            frames += picked
            counts.append(len(picked))
        size = self.options.batch_size
        embeds = torch.cat([self.clip.image_embeds(frames[i:i + size]) for i in range(0, len(frames), size)])
        scores, start = [], 0
        for count in counts:
            scores.append(consistency(embeds[start:start + count], self.options.anchor_weight))
            start += count
        return scores
