"""Colour match: reward = 1 - ||mean RGB of the image - RGB of the colour word in the prompt|| / sqrt(3).

Images (3, H, W) and videos (3, F, H, W) alike: a video's mean is over all its frames.
1 is a perfect match, 0 the opposite corner of the RGB cube. A prompt that names no known colour is an
error (a reward must not silently score 0)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.contracts import Reward

PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "cyan": (0.0, 1.0, 1.0),
    "magenta": (1.0, 0.0, 1.0),
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
    "orange": (1.0, 0.5, 0.0),
    "purple": (0.5, 0.0, 0.5),
    "gray": (0.5, 0.5, 0.5),
    "grey": (0.5, 0.5, 0.5),
}

# the suggested prompts (a run's data when it names none, e.g. the main job's): four to train on and, in the data's
# `split` column, four held out with another shape, which `omnirl eval RUN_DIR` and run.eval_every evaluate on
DEFAULT_PROMPTS = ([{"prompt": f"a {c} square", "split": "train"} for c in ("red", "green", "blue", "yellow")]
                   + [{"prompt": f"a {c} circle", "split": "test"} for c in ("red", "green", "blue", "yellow")])


class ColorOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    region: float = Field(1.0, gt=0, le=1, description="Central fraction of the image that is scored.")


def named_color(prompt: str) -> tuple[float, float, float]:
    for word in re.findall(r"[a-z]+", prompt.lower()):
        if word in PALETTE:
            return PALETTE[word]
    raise ValueError(f"prompt {prompt!r} names no colour the reward knows ({', '.join(sorted(PALETTE))})")


class ColorMatch(Reward):
    batch_invariant = True  # each image scored on its own: batching what piles up changes no score

    def __init__(self, options: ColorOptions | None = None):
        self.options = options or ColorOptions()

    def __call__(self, images: Sequence[Any], prompts: Sequence[str]) -> list[float]:
        scores = []
        for image, prompt in zip(images, prompts):
            arr = image.detach().float().cpu().numpy() if hasattr(image, "detach") else np.asarray(image)
            h, w = arr.shape[-2:]
            f = self.options.region
            dh, dw = round(h * (1 - f) / 2), round(w * (1 - f) / 2)
            crop = arr[..., dh:h - dh, dw:w - dw]
            mean = crop.reshape(3, -1).mean(axis=1)
            target = np.asarray(named_color(prompt))
            scores.append(float(1.0 - np.linalg.norm(mean - target) / math.sqrt(3)))
        return scores
