"""JPEG compressibility: images are encoded at a fixed quality; the reward is minus the size in kB."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.contracts import Reward

DEFAULT_PROMPTS = [
    "a cat", "a dog", "a horse", "a bird", "a fish", "a rabbit", "a lion", "a bear",
    "an owl", "a fox", "a deer", "a frog",
]


class JpegOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    quality: int = Field(95, ge=1, le=100, description="JPEG quality used to measure the size.")
    scale: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="Reward = -(size in kB) x scale; 0.002 (= 1/500) is flow_grpo's and "
        "ddpo-pytorch's jpeg_compressibility."
    )


def to_uint8(image: Any) -> np.ndarray:
    """(3, H, W) float in [0, 1] (tensor or array) -> (H, W, 3) uint8."""
    arr = image.detach().float().cpu().numpy() if hasattr(image, "detach") else np.asarray(image, dtype=np.float32)
    return (arr.transpose(1, 2, 0).clip(0, 1) * 255).round().astype(np.uint8)


class JpegCompressibility(Reward):
    batch_invariant = True  # each image scored on its own: batching what piles up changes no score

    def __init__(self, options: JpegOptions | None = None):
        self.options = options or JpegOptions()

    def __call__(self, images: Sequence[Any], prompts: Sequence[str]) -> list[float]:
        scores = []
        for image in images:
            buffer = io.BytesIO()
            Image.fromarray(to_uint8(image)).save(buffer, format="JPEG", quality=self.options.quality)
            scores.append(-buffer.tell() / 1000.0 * self.options.scale)
        return scores
