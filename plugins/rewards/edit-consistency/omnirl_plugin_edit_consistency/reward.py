"""Rewards for image editing that read more than the output: the record's source image and edit mask.

``edit-consistency`` scores preservation: an edit should leave what its instruction does not name as it was. With the
record's mask (white where the edit may change pixels), only the rest of the image is compared; without one, the
whole image (then the score also counts the edit itself as a change). ``metric``:

- ``pixel``: 1 - the mean absolute difference of the RGB values in [0, 1], weighted by (1 - mask);
- ``lowres``: the same on a ``grid`` x ``grid`` average-pooled version of both images (the pooled mask weighs the
  cells): tolerant of texture, noise and small shifts, strict about colours and layout.

``edit-color`` scores the instruction's colour where the edit happens: 1 - ||mean RGB inside the mask - target|| /
sqrt(3), the target being the record's ``color`` field or else the colour word of the instruction (the ``color``
reward's palette); with ``baseline="source"``, the improvement of that score over the source's. Both score each
sample on its own and raise on a sample they cannot score (no source, no colour).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.contracts import Reward
from omnirl_core.rewards_kit.sources import edit_mask, source_images

PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0), "yellow": (1.0, 1.0, 0.0),
    "cyan": (0.0, 1.0, 1.0), "magenta": (1.0, 0.0, 1.0), "white": (1.0, 1.0, 1.0), "black": (0.0, 0.0, 0.0),
    "orange": (1.0, 0.5, 0.0), "purple": (0.5, 0.0, 0.5), "gray": (0.5, 0.5, 0.5), "grey": (0.5, 0.5, 0.5),
}
"""Colour words and their RGB: the ``color`` reward's, so that the two agree on what "red" is."""


def _image(output: Any) -> torch.Tensor:
    image = output if isinstance(output, torch.Tensor) else torch.as_tensor(output)
    if image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"an editing reward scores images (3, H, W); got an output of shape {tuple(image.shape)}")
    return image.detach().float().cpu()


class EditConsistencyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metric: Literal["pixel", "lowres"] = Field(
        "pixel", description="pixel: mean absolute RGB difference outside the mask; lowres: the same on a grid x grid "
        "average-pooled version (tolerant of texture and small shifts).")
    grid: int = Field(8, ge=1, le=256, description="lowres: cells per side of the pooled comparison.")
    mask_field: str = Field("mask", min_length=1, description="The record field holding the edit mask (white where "
                            "the edit may change pixels); a record without it is compared everywhere.")
    require_mask: bool = Field(False, description="Refuse a record without a mask instead of comparing everywhere.")


class EditConsistency(Reward):
    uses_inputs = True
    batch_invariant = True  # each sample on its own

    def __init__(self, options: EditConsistencyOptions | None = None):
        self.options = options or EditConsistencyOptions()

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str], inputs: Sequence[dict[str, Any]] | None = None,
                 **kwargs: object) -> list[float]:
        records = list(inputs) if inputs is not None else [None] * len(outputs)
        return [self.score(_image(o), r) for o, r in zip(outputs, records)]

    def score(self, image: torch.Tensor, record: dict[str, Any] | None) -> float:
        size = (image.shape[1], image.shape[2])
        source = source_images(record, size)[0]
        mask = edit_mask(record, size, self.options.mask_field)
        if mask is None and self.options.require_mask:
            raise ValueError(f"the prompt's record has no edit mask (its '{self.options.mask_field}' field), and "
                             "require_mask is set")
        keep = torch.ones(size) if mask is None else 1.0 - mask
        diff = (image - source).abs().mean(dim=0)  # (H, W): mean over RGB
        if self.options.metric == "lowres":
            cells = (min(self.options.grid, size[0]), min(self.options.grid, size[1]))
            pool = torch.nn.functional.adaptive_avg_pool2d
            weight = pool(keep[None, None], cells)[0, 0]
            diff = (pool((image * keep)[None], cells)[0] - pool((source * keep)[None], cells)[0]).abs().mean(dim=0)
            diff = diff / weight.clamp_min(1e-6)  # the kept pixels' means per cell
            keep = weight
        total = float(keep.sum())
        if total <= 0:
            raise ValueError("the edit mask covers the whole image: nothing is left to compare with the source")
        return 1.0 - float((diff * keep).sum()) / total


class EditColorOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mask_field: str = Field("mask", min_length=1, description="The record field holding the edit mask (the region "
                            "whose colour is scored); without one the whole image is scored.")
    color_field: str = Field("color", min_length=1, description="The record field naming the target colour; without "
                             "it, the first colour word of the instruction.")
    baseline: Literal["none", "source"] = Field(
        "none", description="none: the score of the result; source: its improvement over the source, the same score "
        "of the source (resized to the result's size) subtracted: 0 for an edit that leaves the region as it was, "
        "positive when it moved it toward the target colour.")


def target_color(prompt: str, record: dict[str, Any] | None, field: str) -> tuple[float, float, float]:
    named = (record or {}).get(field)
    if isinstance(named, str) and named.lower() in PALETTE:
        return PALETTE[named.lower()]
    for word in re.findall(r"[a-z]+", prompt.lower()):
        if word in PALETTE:
            return PALETTE[word]
    raise ValueError(f"neither the record's '{field}' field nor the instruction {prompt!r} names a colour the reward "
                     f"knows ({', '.join(sorted(PALETTE))})")


class EditColor(Reward):
    uses_inputs = True
    batch_invariant = True

    def __init__(self, options: EditColorOptions | None = None):
        self.options = options or EditColorOptions()

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str], inputs: Sequence[dict[str, Any]] | None = None,
                 **kwargs: object) -> list[float]:
        records = list(inputs) if inputs is not None else [None] * len(outputs)
        return [self.score(_image(o), p, r) for o, p, r in zip(outputs, prompts, records)]

    def score(self, image: torch.Tensor, prompt: str, record: dict[str, Any] | None) -> float:
        size = (image.shape[1], image.shape[2])
        mask = edit_mask(record, size, self.options.mask_field)
        weight = torch.ones(size) if mask is None else mask
        if float(weight.sum()) <= 0:
            raise ValueError("the edit mask is empty: no region to score")
        target = torch.tensor(target_color(prompt, record, self.options.color_field))

        def closeness(picture: torch.Tensor) -> float:
            mean = (picture * weight).flatten(1).sum(dim=1) / weight.sum()
            return 1.0 - float(torch.linalg.vector_norm(mean - target)) / math.sqrt(3)

        if self.options.baseline == "source":
            return closeness(image) - closeness(source_images(record, size)[0])
        return closeness(image)
