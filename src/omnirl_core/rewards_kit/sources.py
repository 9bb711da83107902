"""What a reward reads of an edit besides its output: the prompt's condition images (the source; the record's
``image`` field, ``GenRequest.condition_images``) and, where the data has one, the mask of the region the edit may
change (the record's ``mask``: a path, white where pixels may change). Paths are absolute and checked by the data
layer (``omnirl_core.data.images``); a reward that reads them declares ``uses_inputs = True`` (it is then called with
each sample's record) and names the fields in its spec's ``input_fields`` (``--dry-run`` checks the data has them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omnirl_core.contracts.data import CONDITION_IMAGE_FIELD, condition_paths

if TYPE_CHECKING:
    import torch

MASK_FIELD = "mask"


def source_images(record: dict[str, Any] | None, size: tuple[int, int] | None = None) -> list[torch.Tensor]:
    """The record's condition images as (3, H, W) float tensors in [0, 1], resized to ``size`` = (height, width) when
    given (to compare with an output of that size). An error when the record has none: a reward that compares
    against the source cannot score a sample without one."""
    from omnirl_core.data.images import image_tensor

    paths = condition_paths((record or {}).get(CONDITION_IMAGE_FIELD))
    if not paths:
        raise ValueError(f"the prompt's record has no source image (its '{CONDITION_IMAGE_FIELD}' field): this reward "
                         "compares the output with the source of an edit")
    return [image_tensor(p, size) for p in paths]


def edit_mask(record: dict[str, Any] | None, size: tuple[int, int], field: str = MASK_FIELD) -> torch.Tensor | None:
    """The record's edit mask (``field``) as an (H, W) float tensor in [0, 1] at ``size`` (1 where the edit may
    change pixels; area averages when it shrinks, bilinear when it grows), or None when the record has none."""
    path = (record or {}).get(field)
    if path in (None, ""):
        return None
    import numpy as np
    import torch
    from PIL import Image

    from omnirl_core.data.images import load_image

    mask = load_image(str(path)).convert("L")
    if (mask.height, mask.width) != tuple(size):
        shrink = size[0] * size[1] < mask.height * mask.width
        mask = mask.resize((size[1], size[0]), Image.Resampling.BOX if shrink else Image.Resampling.BILINEAR)
    return torch.from_numpy(np.asarray(mask, dtype=np.float32) / 255.0)
