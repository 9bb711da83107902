"""TensorBoard through ``torch.utils.tensorboard`` (the tensorboard package writes the event files).

Steps are the run's step numbers. A resumed run opens its writer with ``purge_step`` = the first step it
computes: TensorBoard's readers then drop whatever an earlier attempt logged at or after that step, so a
step that is redone after a resume shows once, with the values of the run that was kept.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.contracts import Tracker
from omnirl_core.loop.trackers import StepEvent, TrackerRun


class TensorBoardOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    log_dir: str | None = Field(None, description="Event file directory; None: RUN_DIR/tensorboard.")
    images: bool = Field(True, description="Log the sample grids (and evaluation grids) as images.")
    histograms: bool = Field(True, description="Log each step's per-sample rewards as histograms.")
    audio: bool = Field(True, description="Log the speech samples (and evaluation samples) as audio, with their "
                        "texts.")
    audio_clips: int = Field(8, ge=1, description="Speech samples logged per tag and step (the first ones: the "
                             "first prompt's group).")


class TensorBoardTracker(Tracker):
    def __init__(self, options: TensorBoardOptions | None = None):
        self.options = options or TensorBoardOptions()
        self.writer: Any = None

    def start(self, run: TrackerRun) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = Path(self.options.log_dir) if self.options.log_dir else run.run_dir / "tensorboard"
        self.writer = SummaryWriter(str(log_dir), purge_step=run.start_step)
        self.writer.add_text("config", "```\n" + _yaml(run.config) + "\n```", global_step=run.start_step)

    def log(self, event: StepEvent) -> None:
        import numpy as np
        from PIL import Image

        for key, value in event.metrics.items():
            self.writer.add_scalar(key, value, event.step)
        if self.options.images:
            for tag, path in event.images.items():
                with Image.open(path) as image:
                    self.writer.add_image(tag, np.asarray(image.convert("RGB")), event.step, dataformats="HWC")
        if self.options.histograms:
            for tag, values in event.histograms.items():
                finite = [v for v in values if math.isfinite(v)]
                if finite:
                    self.writer.add_histogram(tag, np.asarray(finite, dtype=np.float64), event.step)
        if self.options.audio:  # one audio tag per clip (tag/N), their texts in one text entry (tag/texts)
            for tag, clips in event.audio.items():
                clips = clips[:self.options.audio_clips]
                for n, clip in enumerate(clips):
                    samples, rate = _read_wav(clip.path)
                    self.writer.add_audio(f"{tag}/{n}", samples[None], event.step, sample_rate=rate)
                self.writer.add_text(f"{tag}/texts", "\n\n".join(f"{n}: {c.caption}" for n, c in enumerate(clips)),
                                     event.step)
        self.writer.flush()  # watchable while the run goes on, and little is lost if it is killed

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _read_wav(path: Path) -> tuple[Any, int]:
    """A 16-bit PCM mono WAV file (as the run directory keeps speech) as float32 samples in [-1, 1] and its rate."""
    import wave

    import numpy as np

    with wave.open(str(path), "rb") as wav:
        if wav.getsampwidth() != 2 or wav.getnchannels() != 1:
            raise ValueError(f"{path}: not 16-bit PCM mono ({8 * wav.getsampwidth()}-bit, {wav.getnchannels()} "
                             "channels)")
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
        return pcm.astype(np.float32) / 32768.0, wav.getframerate()


def _yaml(config: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(config, sort_keys=False)
