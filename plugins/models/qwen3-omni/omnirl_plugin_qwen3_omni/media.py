"""A prompt's images and audio -> the thinker's input features and the placeholder token count of each.

What ``Qwen3OmniMoeProcessor`` does for images and audio, built from its sub-processors (image processor,
Whisper feature extractor). The full processor cannot be built without torchvision (its video processor needs
it); these two parts can, so image and audio prompts work anywhere. Video input is not supported here.
"""

from __future__ import annotations

import wave
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnirl_core.errors import UsageError

AUDIO_RATE = 16_000  # the Whisper feature extractor's sampling rate


def load_image(source: Any) -> Any:
    """A path (or a PIL image) -> an RGB PIL image."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as exc:
        raise UsageError(f"Cannot read the image '{source}': {exc}.",
                         hint="Give a path to a PNG/JPEG/... file in the prompt record's 'image' field.") from exc


def load_audio(source: Any) -> np.ndarray:
    """A PCM WAV path (or a float array at 16 kHz) -> mono float32 samples at 16 kHz."""
    if isinstance(source, np.ndarray):
        return source.astype(np.float32)
    path = Path(source)
    try:
        with wave.open(str(path), "rb") as wav:
            rate, channels, width = wav.getframerate(), wav.getnchannels(), wav.getsampwidth()
            raw = wav.readframes(wav.getnframes())
    except (OSError, EOFError, wave.Error) as exc:
        raise UsageError(f"Cannot read the audio '{source}' as PCM WAV: {exc}.",
                         hint="Convert it to 16-bit PCM WAV (e.g. ffmpeg -i in.mp3 -ar 16000 out.wav).") from exc
    if width not in (1, 2, 4):
        raise UsageError(f"Audio '{source}': {8 * width}-bit samples are not supported.",
                         hint="Use 8-, 16- or 32-bit PCM WAV.")
    dtype = {1: np.uint8, 2: np.int16, 4: np.int32}[width]
    samples = np.frombuffer(raw, dtype=dtype).astype(np.float32)
    samples = (samples - 128.0) / 128.0 if width == 1 else samples / float(np.iinfo(dtype).max)
    samples = samples.reshape(-1, channels).mean(axis=1)
    if rate != AUDIO_RATE:  # linear interpolation: enough for speech-band features
        times = np.arange(int(len(samples) * AUDIO_RATE / rate)) / AUDIO_RATE
        samples = np.interp(times, np.arange(len(samples)) / rate, samples).astype(np.float32)
    return samples


def audio_token_count(frames: torch.Tensor, n_window: int) -> torch.Tensor:
    """Audio-encoder outputs (= placeholder tokens) for ``frames`` mel frames.

    The encoder cuts the frames into chunks of 2 * n_window and downsamples each by three stride-2
    convolutions: L -> (L - 1) // 2 + 1, three times (a leftover chunk of 0 frames gives 0)."""

    def downsampled(length: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            length = (length - 1) // 2 + 1
        return length

    chunk = 2 * n_window
    return (frames // chunk) * downsampled(torch.tensor(chunk)) + downsampled(frames % chunk)


class MediaEncoder:
    """Features and placeholder counts for a prompt's images and audio clips."""

    def __init__(self, image_processor: Any, feature_extractor: Any, merge_size: int, n_window: int):
        self.image_processor = image_processor
        self.feature_extractor = feature_extractor
        self.merge_size = merge_size
        self.n_window = n_window

    def images(self, sources: list[Any]) -> tuple[dict[str, torch.Tensor], list[int]]:
        if self.image_processor is None:
            raise UsageError("This checkpoint has no image processor (preprocessor_config.json), so image prompts "
                             "cannot be encoded.")
        out = self.image_processor(images=[load_image(s) for s in sources], return_tensors="pt")
        grid = out["image_grid_thw"]
        counts = (grid.prod(dim=-1) // self.merge_size**2).tolist()
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}, counts

    def audio(self, sources: list[Any]) -> tuple[dict[str, torch.Tensor], list[int]]:
        if self.feature_extractor is None:
            raise UsageError("This checkpoint has no audio feature extractor (preprocessor_config.json), so audio "
                             "prompts cannot be encoded.")
        out = self.feature_extractor(
            [load_audio(s) for s in sources], sampling_rate=AUDIO_RATE, padding=True, truncation=False,
            return_attention_mask=True, return_tensors="pt",
        )
        mask = out["attention_mask"].long()
        counts = audio_token_count(mask.sum(-1), self.n_window).tolist()
        return {"input_features": out["input_features"], "feature_attention_mask": mask}, counts


def collate_media(media: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The media of a batch of rows as model keyword arguments: image patches and grids concatenated in row
    order; audio features padded to the longest clip (mask 0 on padding) and stacked."""
    out: dict[str, torch.Tensor] = {}
    images = [m for m in media if "pixel_values" in m]
    if images:
        out["pixel_values"] = torch.cat([m["pixel_values"] for m in images])
        out["image_grid_thw"] = torch.cat([m["image_grid_thw"] for m in images])
    clips = [m for m in media if "input_features" in m]
    if clips:
        frames = max(m["input_features"].shape[-1] for m in clips)

        def pad(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, frames - x.shape[-1]))

        out["input_features"] = torch.cat([pad(m["input_features"]) for m in clips])
        out["feature_attention_mask"] = torch.cat([pad(m["feature_attention_mask"]) for m in clips])
    return out
