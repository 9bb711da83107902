"""Speech outputs as audio files: 16-bit PCM mono WAV (Python's ``wave``; every player and browser reads it)."""

from __future__ import annotations

import wave
from pathlib import Path

from omnirl_core.contracts.data import Speech


def write_wav(path: Path, speech: Speech) -> Path:
    """``speech``'s waveform (clipped to [-1, 1]) at its own sample rate."""
    import torch

    pcm = (speech.waveform.detach().float().clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
    tmp = path.with_name(path.name + ".tmp")
    with wave.open(str(tmp), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(speech.sample_rate)
        out.writeframes(pcm.numpy().tobytes())
    tmp.replace(path)
    return path
