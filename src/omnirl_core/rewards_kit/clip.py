"""CLIP through transformers, shared by the CLIP-based reward plugins (clipscore, pickscore, aesthetic, hpsv2,
geneval, video rewards).

- ``load_clip``: a transformers ``CLIPModel`` + ``CLIPProcessor`` from a local directory or a hub id. A local
  directory is checked first and the error names the files it lacks; with ``HF_HUB_OFFLINE=1`` a hub id is
  looked up in the local cache only (``local_files_only``), never on the network.
- ``load_options_clip``: the CLIP a reward's options ask for (``preset: tiny`` or ``path``); ``cosine``: the
  cosine of each (image, text) pair.
- ``ClipPreprocessor``: what ``CLIPProcessor`` does to a PIL image (resize the shortest edge, centre crop,
  rescale, normalise), done on tensors. Outputs are first quantised to uint8 like a saved PNG, and the
  resize reproduces Pillow's exactly: a separable antialiased bicubic (a = -0.5) in 22-bit fixed point,
  horizontal pass first, each pass rounded to uint8.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    import numpy as np

from omnirl_core.errors import UsageError
from omnirl_core.rewards_kit.tiny_clip import tiny_clip_directory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_PROCESSOR_CONFIGS = ("preprocessor_config.json", "processor_config.json")  # transformers 4.x, 5.x


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def is_local(path: str) -> bool:
    return Path(path).expanduser().exists() or path.startswith((".", "/", "~"))


def missing_files(directory: Path, model: bool = True, processor: bool = True) -> list[str]:
    """The files a CLIP checkpoint directory lacks (alternatives joined with ' | ')."""
    missing = []
    if model:
        if not (directory / "config.json").is_file():
            missing.append("config.json")
        if not any((directory / f).is_file() for f in _WEIGHT_FILES):
            missing.append("model.safetensors")
    if processor:
        if not any((directory / f).is_file() for f in _PROCESSOR_CONFIGS):
            missing.append("preprocessor_config.json")
        has_tokenizer = (directory / "tokenizer.json").is_file() or (
            (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file())
        if not has_tokenizer:
            missing.append("tokenizer.json | vocab.json + merges.txt")
    return missing


def _missing_in_cache(repo_id: str, model: bool, processor: bool) -> list[str]:
    from huggingface_hub import try_to_load_from_cache

    def cached(name: str) -> bool:
        return isinstance(try_to_load_from_cache(repo_id, name), str)

    missing = []
    if model:
        missing += [] if cached("config.json") else ["config.json"]
        missing += [] if any(cached(f) for f in _WEIGHT_FILES) else ["model.safetensors"]
    if processor:
        missing += [] if any(cached(f) for f in _PROCESSOR_CONFIGS) else ["preprocessor_config.json"]
        tok = cached("tokenizer.json") or (cached("vocab.json") and cached("merges.txt"))
        missing += [] if tok else ["tokenizer.json | vocab.json + merges.txt"]
    return missing


def _not_found(label: str, path: str, option: str, missing: list[str], cause: Exception | None) -> UsageError:
    from huggingface_hub import constants

    if is_local(path):
        where = [f"Put them in {Path(path).expanduser()}."]
    else:
        where = [f"Looked in the Hugging Face cache ({constants.HF_HUB_CACHE})"
                 + (" only: HF_HUB_OFFLINE=1 is set." if hub_offline() else "; the hub was unreachable or "
                    "does not have them.")]
    details = where + ([f"{type(cause).__name__}: {str(cause).splitlines()[0]}"] if cause and str(cause) else [])
    hint = (f"Download them (e.g. `hf download {path} --local-dir DIR`, or copy them from a machine that has "
            f"them) and set rewards.<i>.options.{option}=DIR, or use preset=tiny for a random-weight test model."
            if not is_local(path) else
            f"Copy the checkpoint's files there (`hf download <repo> --local-dir {path}`), or point "
            f"rewards.<i>.options.{option} at another directory, or use preset=tiny.")
    return UsageError(f"{label}: {', '.join(missing) or 'files'} missing for '{path}'.", details=details, hint=hint)


def from_pretrained(cls: Any, path: str, label: str, option: str, *, model: bool, processor: bool,
                    **kwargs: object) -> Any:
    """``cls.from_pretrained`` for a local directory or a hub id, offline-safe, with an error that names the
    missing files and where they go."""
    if is_local(path):
        local = Path(path).expanduser()
        missing = missing_files(local, model=model, processor=processor)
        if missing:
            raise _not_found(label, path, option, missing, None)
        return cls.from_pretrained(str(local), **kwargs)
    offline = hub_offline()
    try:
        return cls.from_pretrained(path, local_files_only=offline, **kwargs)
    except (OSError, ValueError) as exc:
        raise _not_found(label, path, option, _missing_in_cache(path, model, processor), exc) from exc


@dataclass
class Clip:
    model: Any
    processor: Any
    preprocess: ClipPreprocessor
    device: torch.device
    dtype: torch.dtype
    split_special_tokens: bool = False
    """Tokenise special-token strings in a prompt as plain text, as the ``clip`` / open_clip tokenizers do
    (laion's HF tokenizers declare ``!`` as their pad token, which would otherwise become a special token)."""

    @torch.no_grad()
    def image_embeds(self, outputs: Sequence[Any]) -> torch.Tensor:
        """Projected image embeddings (B, D) in float32 (not normalised)."""
        pixels = self.preprocess(outputs).to(self.device, self.dtype)
        return pooled(self.model.get_image_features(pixel_values=pixels)).float()

    @torch.no_grad()
    def text_embeds(self, prompts: Sequence[str]) -> torch.Tensor:
        """Projected text embeddings (B, D) in float32 (not normalised); texts longer than the model's
        context are truncated as CLIPProcessor does."""
        tok = self.processor.tokenizer
        max_length = min(tok.model_max_length, self.model.config.text_config.max_position_embeddings)
        inputs = tok(list(prompts), padding=True, truncation=True, max_length=max_length, return_tensors="pt",
                     split_special_tokens=self.split_special_tokens)
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        return pooled(self.model.get_text_features(**inputs)).float()


def pooled(features: Any) -> torch.Tensor:
    """transformers 5 returns a model output whose ``pooler_output`` is the projection; 4.x a tensor."""
    return features if isinstance(features, torch.Tensor) else features.pooler_output


def load_clip(path: str, processor_path: str | None, *, label: str, device: str = "auto",
              dtype: str = "float32", option: str = "path", processor_option: str = "processor_path",
              resize_on: Literal["uint8", "float"] = "uint8", split_special_tokens: bool = False) -> Clip:
    """A CLIPModel and its processor (from ``processor_path``, else from ``path``), eval mode, on ``device``;
    ``resize_on``: see ``ClipPreprocessor``, ``split_special_tokens``: see ``Clip``."""
    from transformers import CLIPModel, CLIPProcessor
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    torch_device, torch_dtype = resolve_device(device), DTYPES[dtype]
    same = processor_path in (None, path)
    model = from_pretrained(CLIPModel, path, label, option, model=True, processor=same, dtype=torch_dtype)
    processor = from_pretrained(CLIPProcessor, path if same or processor_path is None else processor_path, label,
                                option if same else processor_option, model=False, processor=True)
    model = model.to(torch_device).eval().requires_grad_(False)
    return Clip(model, processor, ClipPreprocessor.from_image_processor(processor.image_processor, resize_on),
                torch_device, torch_dtype, split_special_tokens)


def load_options_clip(options: Any, default_path: str, label: str, tiny_name: str, tiny_act: str,
                      processor_path: str | None = None, split_special_tokens: bool = False) -> Clip:
    """The CLIP a CLIP-based reward's options (``preset``, ``path``, ``device``, ``dtype``) ask for: the tiny
    preset's directory (a random CLIP with activation ``tiny_act``), or ``path`` (+ ``processor_path``)."""
    if options.preset == "tiny":
        path, processor_path = str(tiny_clip_directory(tiny_name, tiny_act)), None
    else:
        path = options.path or default_path
    return load_clip(path, processor_path, label=label, device=options.device, dtype=options.dtype,
                     split_special_tokens=split_special_tokens)


def cosine(clip: Clip, outputs: Sequence[Any], texts: Sequence[str], batch_size: int) -> torch.Tensor:
    """cos(image_i, text_i) for each pair, in float32; each distinct text is encoded once."""
    unique = list(dict.fromkeys(texts))
    text = F.normalize(clip.text_embeds(unique), dim=-1)
    index = torch.tensor([unique.index(t) for t in texts], device=text.device)
    image = torch.cat([clip.image_embeds(outputs[i:i + batch_size]) for i in range(0, len(outputs), batch_size)])
    return (F.normalize(image, dim=-1) * text[index]).sum(dim=-1)


def to_uint8(output: torch.Tensor | np.ndarray) -> torch.Tensor:
    """(3, H, W) in [0, 1] (tensor or array) -> (3, H, W) uint8, rounded like a saved 8-bit image."""
    x = output.detach() if isinstance(output, torch.Tensor) else torch.as_tensor(output)
    x = x.float().cpu()
    if x.dim() != 3 or x.shape[0] not in (1, 3):
        raise ValueError(f"expected an image (3, H, W) in [0, 1], got shape {tuple(x.shape)}")
    if x.shape[0] == 1:
        x = x.expand(3, -1, -1)
    return (x.clamp(0, 1) * 255).round().to(torch.uint8)


_PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed point for 8-bit images (libImaging/Resample.c)


def _bicubic(x: float, a: float = -0.5) -> float:
    x = abs(x)
    if x < 1:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    if x < 2:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


@functools.lru_cache(maxsize=64)
def pil_bicubic_weights(in_size: int, out_size: int) -> torch.Tensor:
    """Pillow's resampling matrix (out_size, in_size) for one axis: bicubic (a = -0.5), support widened by
    the downscale factor (antialiasing), each row normalised, then rounded to 22-bit fixed point."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = 2.0 * filterscale
    weights = torch.zeros(out_size, in_size, dtype=torch.float64)
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size)
        k = [_bicubic((x - center + 0.5) / filterscale) for x in range(xmin, xmax)]
        total = sum(k)
        for i, w in enumerate(k):
            w = w / total if total != 0 else w
            weights[xx, xmin + i] = math.trunc(w * (1 << _PRECISION_BITS) + (0.5 if w >= 0 else -0.5))
    return weights


def _resize_pass(x: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """One separable pass of Pillow's 8-bit resize along ``dim`` (-1: width, -2: height), exact: integer
    products summed in float64 (< 2**53), rounded and clipped like Pillow's clip8."""
    if x.shape[dim] == size:
        return x
    k = pil_bicubic_weights(x.shape[dim], size)
    y = x.double().movedim(dim, -1) @ k.T
    y = torch.floor((y + (1 << (_PRECISION_BITS - 1))) / (1 << _PRECISION_BITS)).clamp(0, 255)
    return y.movedim(-1, dim).float()


@dataclass
class ClipPreprocessor:
    """CLIPImageProcessor's steps on (3, H, W) uint8 tensors: resize the shortest edge (bicubic), centre
    crop (zero padding when the crop is larger), rescale, normalise.

    ``resize_on="uint8"`` is CLIPProcessor (and open_clip's PIL pipeline): Pillow's 8-bit resize, crop offsets
    rounded down. ``"float"`` is torchvision on tensors after ``ToTensor`` (hpsv2's ``preprocess_val``):
    rescale first, antialiased bicubic on floats without rounding, crop offsets rounded to nearest."""

    shortest_edge: int | None
    size_hw: tuple[int, int] | None
    crop_hw: tuple[int, int] | None
    rescale: float | None
    mean: torch.Tensor | None
    std: torch.Tensor | None
    resize_on: Literal["uint8", "float"] = "uint8"
    round_crop: bool = False
    """Crop offsets rounded to nearest (torchvision's CenterCrop, also on PIL images) instead of down."""

    @classmethod
    def from_image_processor(cls, ip: Any, resize_on: Literal["uint8", "float"] = "uint8") -> ClipPreprocessor:
        resample = getattr(ip, "resample", 3)
        if int(getattr(resample, "value", resample)) != 3:  # PILImageResampling.BICUBIC
            raise ValueError(f"only bicubic resizing is supported, the processor asks for {resample!r}")
        size = dict(ip.size) if ip.do_resize else {}
        size = {k: v for k, v in size.items() if v is not None}
        crop = {k: v for k, v in dict(ip.crop_size or {}).items() if v is not None} if ip.do_center_crop else {}
        mean = torch.tensor(ip.image_mean, dtype=torch.float32).view(3, 1, 1) if ip.do_normalize else None
        std = torch.tensor(ip.image_std, dtype=torch.float32).view(3, 1, 1) if ip.do_normalize else None
        return cls(
            shortest_edge=size.get("shortest_edge"),
            size_hw=(size["height"], size["width"]) if "height" in size else None,
            crop_hw=(crop["height"], crop["width"]) if crop else None,
            rescale=float(ip.rescale_factor) if ip.do_rescale else None,
            mean=mean,
            std=std,
            resize_on=resize_on,
        )

    def output_size(self, h: int, w: int) -> tuple[int, int]:
        if self.shortest_edge is not None:  # transformers' get_resize_output_image_size(default_to_square=False)
            short, long = (w, h) if w <= h else (h, w)
            new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
            return (new_long, new_short) if w <= h else (new_short, new_long)
        return self.size_hw or (h, w)

    def one(self, image: torch.Tensor) -> torch.Tensor:
        x = image.float()
        h, w = x.shape[-2:]
        nh, nw = self.output_size(h, w)
        torchvision = self.resize_on == "float"
        if torchvision:
            x = x / 255 if self.rescale is not None else x  # ToTensor
            if (nh, nw) != (h, w):
                x = F.interpolate(x[None], size=(nh, nw), mode="bicubic", antialias=True, align_corners=False)[0]
        else:
            x = _resize_pass(_resize_pass(x, nw, -1), nh, -2)  # Pillow: horizontal pass, then vertical
        if self.crop_hw is not None:
            ch, cw = self.crop_hw
            ph, pw = max(ch - nh, 0), max(cw - nw, 0)
            if ph or pw:  # transformers puts ceil(pad / 2) before, torchvision after
                before_h, before_w = (ph // 2, pw // 2) if torchvision else (ph - ph // 2, pw - pw // 2)
                x = F.pad(x, (before_w, pw - before_w, before_h, ph - before_h))
                nh, nw = x.shape[-2:]
            if torchvision or self.round_crop:
                top, left = round((nh - ch) / 2.0), round((nw - cw) / 2.0)  # torchvision: int(round(.))
            else:
                top, left = (nh - ch) // 2, (nw - cw) // 2
            x = x[:, top:top + ch, left:left + cw]
        if self.rescale is not None and not torchvision:
            x = x * self.rescale
        if self.mean is not None and self.std is not None:  # both, or neither (do_normalize)
            x = (x - self.mean) / self.std
        return x

    def __call__(self, outputs: Sequence[Any]) -> torch.Tensor:
        return torch.stack([self.one(to_uint8(o)) for o in outputs])
