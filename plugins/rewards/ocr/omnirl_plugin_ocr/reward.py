"""OCR reward: r = max(0, 1 - Levenshtein(read, target) / len(target)), case-insensitive by default.

The target is the first quoted span of the prompt ('a sign that says "OPEN"' -> OPEN), else the whole
prompt. RapidOCR runs PP-OCR detection + recognition through onnxruntime with the models shipped in its
wheel (no download). Each reward thread gets its own engine; onnxruntime's own threads are capped so
that OCR overlapping the rollout leaves it cores.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.contracts import Reward

DEFAULT_PROMPTS = [
    'a shop sign that says "OPEN"',
    'a poster with the word "OMNI"',
    'a neon sign reading "FLOW"',
    'a street sign that says "STOP"',
    'a book cover titled "RL"',
    'a banner that says "HELLO WORLD"',
]
_QUOTED = re.compile(r"[\"“”'‘’]([^\"“”'‘’]+)[\"“”'‘’]")


class OCROptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    case_sensitive: bool = Field(False, description="Compare letters with their case.")
    min_side: int = Field(
        96, ge=16, description="Images are upscaled (nearest) so their shorter side is at least this many "
        "pixels: the detector needs a few pixels per stroke."
    )
    threads: int = Field(1, ge=1, description="onnxruntime intra-op threads per OCR call.")
    text_score: float = Field(0.5, ge=0, le=1, description="Recognitions below this confidence are dropped.")


def target_text(prompt: str) -> str:
    match = _QUOTED.search(prompt)
    return (match.group(1) if match else prompt).strip()


def levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def text_score(read: str, target: str, case_sensitive: bool = False) -> float:
    if not case_sensitive:
        read, target = read.lower(), target.lower()
    read, target = " ".join(read.split()), " ".join(target.split())
    if not target:
        return 0.0
    return max(0.0, 1.0 - levenshtein(read, target) / len(target))


def to_uint8_image(output: Any, min_side: int) -> np.ndarray:
    """(3, H, W) in [0, 1] (a tensor or an array) -> (H', W', 3) uint8, upscaled to ``min_side``."""
    from PIL import Image

    array = output.detach().cpu().float().numpy() if hasattr(output, "detach") else np.asarray(output)
    if array.ndim == 3 and array.shape[0] in (1, 3):
        array = np.transpose(array, (1, 2, 0))
    image = Image.fromarray((np.clip(array, 0, 1) * 255).round().astype(np.uint8).squeeze())
    scale = max(1, -(-min_side // min(image.size)))
    if scale > 1:
        image = image.resize((image.width * scale, image.height * scale), Image.NEAREST)
    return np.asarray(image.convert("RGB"))


class OCRReward(Reward):
    def __init__(self, options: OCROptions | None = None):
        self.options = options or OCROptions()
        self._local = threading.local()

    def _engine(self) -> Any:
        engine = getattr(self._local, "engine", None)
        if engine is None:
            from rapidocr import RapidOCR

            engine = RapidOCR(params={
                "Global.log_level": "critical",
                "Global.text_score": self.options.text_score,
                "EngineConfig.onnxruntime.intra_op_num_threads": self.options.threads,
                "EngineConfig.onnxruntime.inter_op_num_threads": 1,
            })
            self._local.engine = engine
        return engine

    def read(self, output: Any) -> str:
        result = self._engine()(to_uint8_image(output, self.options.min_side))
        return " ".join(result.txts) if result.txts else ""

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str]) -> list[float]:
        return [text_score(self.read(o), target_text(p), self.options.case_sensitive)
                for o, p in zip(outputs, prompts)]
