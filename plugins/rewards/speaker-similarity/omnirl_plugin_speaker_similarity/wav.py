"""Reading a reference voice: PCM WAV files through the standard library's ``wave`` module (8-bit unsigned, 16-,
24- and 32-bit signed integers), channels averaged to mono, scaled to [-1, 1]. Anything else (float WAV,
compressed formats, other containers) is an error that names the file and how to convert it."""

from __future__ import annotations

import wave
from pathlib import Path
from typing import Any

CONVERT = "Convert it to 16-bit PCM WAV, e.g. `ffmpeg -i {path} -ac 1 -c:a pcm_s16le {stem}.pcm16.wav`."


def read_wav(path: str | Path) -> tuple[Any, int]:
    """(mono float32 numpy array in [-1, 1], sample rate) of a PCM WAV file."""
    import numpy as np

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reference voice {path} does not exist (a relative `voice` path in the data is relative to "
                                f"the data file; others to the working directory, {Path.cwd()}). Give an absolute "
                                "path, or one relative to the data file in the record's `voice` field.")
    hint = CONVERT.format(path=path, stem=path.with_suffix(""))
    try:
        with wave.open(str(path), "rb") as f:
            channels, width, rate, frames = f.getnchannels(), f.getsampwidth(), f.getframerate(), f.getnframes()
            raw = f.readframes(frames)
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"reference voice {path} is not a PCM WAV file ({exc}). {hint}") from exc
    if width == 1:
        x = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128) / 128
    elif width in (2, 4):
        x = np.frombuffer(raw, dtype=f"<i{width}").astype(np.float32) / 2 ** (8 * width - 1)
    elif width == 3:  # little-endian 24-bit: sign-extend into int32
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        x = ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8).astype(np.float32) / 2**23
    else:
        raise ValueError(f"reference voice {path} has {8 * width}-bit samples, which PCM WAV reading does not "
                         f"support. {hint}")
    x = x.reshape(-1, channels).mean(axis=1)
    if x.size == 0:
        raise ValueError(f"reference voice {path} has no samples. Record or pick a reference of a few seconds.")
    return x.astype(np.float32), rate
