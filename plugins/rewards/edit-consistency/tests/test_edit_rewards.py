"""edit-consistency and edit-color on hand-made images: preservation outside the mask (pixel and coarse-grid), the
target colour inside it, what they read of the record, and their refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omnirl_plugin_edit_consistency.reward import (
    EditColor,
    EditColorOptions,
    EditConsistency,
    EditConsistencyOptions,
)
from PIL import Image

from omnirl_core.testing import check_import_is_cheap

SIZE = 16


@pytest.fixture
def record(tmp_path: Path) -> dict:
    """A 32 x 32 source (grey, a blue square in the top-left quarter) and its mask (that quarter), as files."""
    source = Image.new("RGB", (32, 32), (128, 128, 128))
    source.paste((0, 0, 255), (0, 0, 16, 16))
    mask = Image.new("L", (32, 32), 0)
    mask.paste(255, (0, 0, 16, 16))
    source.save(tmp_path / "source.png")
    mask.save(tmp_path / "mask.png")
    return {"image": str(tmp_path / "source.png"), "mask": str(tmp_path / "mask.png"), "color": "red"}


def source_like() -> torch.Tensor:
    """The source at the output size (16 x 16): what an edit that changes nothing returns."""
    image = torch.full((3, SIZE, SIZE), 128 / 255)
    image[:, :8, :8] = torch.tensor([0.0, 0.0, 1.0])[:, None, None]
    return image


def test_preservation_scores_only_outside_the_mask(record):
    reward = EditConsistency()
    same = source_like()
    edited = same.clone()
    edited[:, :8, :8] = torch.tensor([1.0, 0.0, 0.0])[:, None, None]  # the square made red: inside the mask
    spoiled = edited.clone()
    spoiled[:, 8:, :] = 1.0  # the lower half made white: outside the mask
    scores = reward([same, edited, spoiled], ["make it red"] * 3, inputs=[record] * 3)
    assert scores[0] == pytest.approx(1.0, abs=1e-6) and scores[1] == pytest.approx(1.0, abs=1e-6)
    # 128 of the 192 kept pixels moved by 1 - 128/255 in every channel
    assert scores[2] == pytest.approx(1 - (128 / 192) * (1 - 128 / 255), abs=1e-6)
    no_mask = {k: v for k, v in record.items() if k != "mask"}
    assert reward([edited], ["p"], inputs=[no_mask])[0] < 1.0  # without a mask the edit itself counts
    with pytest.raises(ValueError, match="no edit mask"):
        EditConsistency(EditConsistencyOptions(require_mask=True))([same], ["p"], inputs=[no_mask])
    with pytest.raises(ValueError, match="no source image"):
        reward([same], ["p"], inputs=[{"mask": record["mask"]}])


def test_the_coarse_grid_forgives_what_the_pixels_do_not(record):
    noise = source_like() + 0.2 * torch.sign(torch.randn(3, SIZE, SIZE, generator=torch.Generator().manual_seed(0)))
    noise = noise.clamp(0, 1)
    pixel = EditConsistency()([noise], ["p"], inputs=[record])[0]
    lowres = EditConsistency(EditConsistencyOptions(metric="lowres", grid=4))([noise], ["p"], inputs=[record])[0]
    assert lowres > pixel + 0.05 and 0.0 < pixel < 0.9


def test_edit_color_scores_the_instructed_colour_inside_the_mask(record):
    reward = EditColor()
    edited = source_like()
    edited[:, :8, :8] = torch.tensor([1.0, 0.0, 0.0])[:, None, None]
    untouched = source_like()
    # the record's colour (red) wins over the instruction's words; inside the mask only
    assert reward([edited, untouched], ["paint it green"] * 2, inputs=[record] * 2) == \
        pytest.approx([1.0, 1 - math.sqrt(2) / math.sqrt(3)])
    without_color = {k: v for k, v in record.items() if k != "color"}
    assert reward([edited], ["paint it green"], inputs=[without_color])[0] == pytest.approx(1 - math.sqrt(2) / math.sqrt(3))
    whole = reward([edited], ["make it red"], inputs=[{}])[0]  # no mask: the whole image's mean colour
    assert whole < 0.9
    with pytest.raises(ValueError, match="names a colour"):
        EditColor(EditColorOptions(color_field="target"))([edited], ["make it nicer"], inputs=[{}])


def test_edit_color_against_the_source_scores_the_improvement(record):
    """baseline=source: the result's score less the source's (a blue square asked to be red): 0 for an edit that
    changes nothing, the whole gap for the exact colour, negative for a move away from it."""
    reward = EditColor(EditColorOptions(baseline="source"))
    edited = source_like()
    edited[:, :8, :8] = torch.tensor([1.0, 0.0, 0.0])[:, None, None]
    worse = source_like()
    worse[:, :8, :8] = torch.tensor([0.0, 1.0, 1.0])[:, None, None]  # cyan: farther from red than blue is
    gap = math.sqrt(2) / math.sqrt(3)  # blue's distance to red, / sqrt(3)
    scores = reward([source_like(), edited, worse], ["make it red"] * 3, inputs=[record] * 3)
    assert scores[0] == pytest.approx(0.0, abs=1e-6) and scores[1] == pytest.approx(gap, abs=1e-6)
    assert scores[2] == pytest.approx(gap - math.sqrt(3) / math.sqrt(3), abs=1e-6)
    # the same ordering as the plain score, shifted by the record's own constant
    plain = EditColor()([source_like(), edited, worse], ["make it red"] * 3, inputs=[record] * 3)
    assert [a - b for a, b in zip(plain, scores)] == pytest.approx([1 - gap] * 3, abs=1e-6)
    with pytest.raises(ValueError, match="no source image"):
        reward([edited], ["make it red"], inputs=[{"mask": record["mask"], "color": "red"}])


def test_outputs_must_be_images():
    with pytest.raises(ValueError, match=r"scores images \(3, H, W\)"):
        EditColor()([torch.zeros(3, 2, 8, 8)], ["make it red"], inputs=[{}])


def test_importing_the_plugin_is_cheap():
    check_import_is_cheap("omnirl_plugin_edit_consistency")
