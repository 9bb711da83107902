"""OCR reward with the real RapidOCR models: rendered text scores high, noise scores 0."""

from __future__ import annotations

import numpy as np
import pytest
from omnirl_plugin_ocr.reward import OCROptions, OCRReward, levenshtein, target_text, text_score
from PIL import Image, ImageDraw, ImageFont


def _rendered(text: str) -> np.ndarray:
    image = Image.new("RGB", (320, 72), "white")
    ImageDraw.Draw(image).text((10, 8), text, fill="black", font=ImageFont.load_default(size=44))
    return np.transpose(np.asarray(image, dtype=np.float32) / 255.0, (2, 0, 1))  # (3, H, W) in [0, 1]


def test_text_helpers():
    assert target_text('a sign that says "OPEN" at night') == "OPEN"
    assert target_text("no quotes") == "no quotes"
    assert levenshtein("kitten", "sitting") == 3
    assert text_score("open", "OPEN") == 1.0
    assert text_score("OPFN", "OPEN") == pytest.approx(0.75)
    assert text_score("", "OPEN") == 0.0
    assert text_score("OPEN", "OPEN", case_sensitive=True) == 1.0


def test_reads_rendered_text_and_not_noise():
    reward = OCRReward(OCROptions())
    noise = np.random.default_rng(0).random((3, 32, 32)).astype(np.float32)
    scores = reward([_rendered("HELLO"), _rendered("HELLO"), noise],
                    ['a sign that says "HELLO"', 'a sign that says "WORLD"', 'a sign that says "HELLO"'])
    assert scores[0] == 1.0
    assert scores[1] < 0.5
    assert scores[2] == 0.0
