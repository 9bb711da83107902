"""Condition images of prompt records (an edit's source, reference pictures): the record's ``image`` field.

A record names them by path (relative to the data file, made absolute by ``sources``), or holds them: a Hugging Face
``Image`` feature (a PIL image) or an image stored in Parquet (``{"bytes": ..., "path": ...}``). Held images are
written once to the cache (``$OMNIRL_CACHE/images/<sha256>.png``, by content) so that every record names its images by
path: a request stays plain data (JSON, Ray, the reward server) and an image is read where it is used.

Checking a record opens each image's header (missing or unreadable: a ``ConfigError`` naming ``file:line``); decoding
happens where the image is used (``load_image``: RGB, cached by path and modification time).
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnirl_core.contracts.data import CONDITION_IMAGE_FIELD
from omnirl_core.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from PIL import Image


def _cache_file(data: bytes, suffix: str) -> str:
    from omnirl_core.presets import cache_dir

    folder = cache_dir() / "images"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{hashlib.sha256(data).hexdigest()}{suffix}"
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return str(path)


def _held_image(value: Any, where: str) -> str | None:
    """A held image (PIL, or Parquet's bytes struct) written to the cache: its path; None for anything else."""
    from PIL import Image

    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return _cache_file(buffer.getvalue(), ".png")
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        if value.get("bytes"):
            return _cache_file(bytes(value["bytes"]), Path(str(value.get("path") or "")).suffix or ".img")
        if value.get("path"):
            return str(value["path"])
        raise ConfigError(f"{where}: the '{CONDITION_IMAGE_FIELD}' field holds an image with neither bytes nor a path.")
    return None


def check_image(path: str, where: str) -> None:
    """A condition image exists and its header reads as an image; else a ``ConfigError`` naming ``where``."""
    from PIL import Image, UnidentifiedImageError

    if "://" in path:
        raise ConfigError(f"{where}: condition image '{path}' is a URL; condition images must be local files.",
                          hint="Download the images and name them by path (relative to the data file).")
    if not Path(path).is_file():
        raise ConfigError(f"{where}: condition image '{path}' not found.",
                          hint="Paths in the 'image' field are relative to the data file's directory.")
    try:
        with Image.open(path) as image:
            image.size  # noqa: B018 - reading the header is the check
    except (UnidentifiedImageError, OSError) as exc:
        raise ConfigError(f"{where}: condition image '{path}' is not a readable image ({type(exc).__name__}: {exc}).",
                          hint="Give PNG, JPEG or WebP files.") from None


def condition_field(record: dict[str, Any], where: str) -> dict[str, Any]:
    """``record`` with its ``image`` field as checked paths (held images written to the cache first)."""
    value = record.get(CONDITION_IMAGE_FIELD)
    if value is None or value == "" or value == []:
        return record
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    paths = []
    for item in items:
        held = _held_image(item, where)
        if held is None and not isinstance(item, str):
            raise ConfigError(f"{where}: the '{CONDITION_IMAGE_FIELD}' field holds a {type(item).__name__}; expected "
                              "a path, a list of paths or an image.")
        path = held if held is not None else str(item)
        check_image(path, where)
        paths.append(path)
    return {**record, CONDITION_IMAGE_FIELD: paths if isinstance(value, (list, tuple)) else paths[0]}


@functools.lru_cache(maxsize=256)
def _decoded(path: str, mtime_ns: int) -> Image.Image:
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def load_image(path: str) -> Image.Image:
    """A condition image as an RGB PIL image (decoded once per path and modification time)."""
    return _decoded(path, os.stat(path).st_mtime_ns).copy()


def image_tensor(path: str, size: tuple[int, int] | None = None) -> torch.Tensor:
    """A condition image as a float tensor (3, H, W) in [0, 1]; ``size`` = (height, width) resizes it, as a reward
    compares it with an output of that size: area averages when it shrinks (no ringing at edges), bicubic when it
    grows."""
    import numpy as np
    import torch
    from PIL import Image

    image = load_image(path)
    if size is not None and (image.height, image.width) != tuple(size):
        shrink = size[0] * size[1] < image.height * image.width
        image = image.resize((size[1], size[0]), Image.Resampling.BOX if shrink else Image.Resampling.BICUBIC)
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()
