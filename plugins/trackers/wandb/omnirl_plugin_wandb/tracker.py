"""Weights & Biases. The run's files go to RUN_DIR/wandb/; the W&B run id is kept in RUN_DIR/wandb-run.json so
that a resumed omnirl run continues the same W&B run (``resume="allow"``).

W&B keeps one value per step and never goes back: after a resume, steps the earlier attempt logged past its
last checkpoint are skipped by W&B itself (it warns), the rest continue at the run's step numbers.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.contracts import Tracker
from omnirl_core.loop.trackers import StepEvent, TrackerRun

RUN_ID_FILE = "wandb-run.json"


class WandbOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    project: str = Field("omnirl", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (user or team); None: the default of the login.")
    name: str | None = Field(None, description="Run name shown in W&B; None: the run directory's name.")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="online, offline (files only, `wandb sync` later) or disabled; None: WANDB_MODE, else "
        "wandb's default."
    )
    tags: list[str] = Field(default_factory=list, description="Tags of the W&B run.")
    images: bool = Field(True, description="Log the sample grids (and evaluation grids) as images.")
    histograms: bool = Field(True, description="Log each step's per-sample rewards as histograms.")
    audio: bool = Field(True, description="Log the speech samples (and evaluation samples) as audio, captioned "
                        "with their texts.")
    audio_clips: int = Field(8, ge=1, description="Speech samples logged per tag and step (the first ones: the "
                             "first prompt's group).")


class WandbTracker(Tracker):
    def __init__(self, options: WandbOptions | None = None):
        self.options = options or WandbOptions()
        self.run: Any = None

    def start(self, run: TrackerRun) -> None:
        import wandb

        o = self.options
        id_file = run.run_dir / RUN_ID_FILE
        run_id = json.loads(id_file.read_text())["id"] if id_file.is_file() else secrets.token_hex(4)
        if not id_file.is_file():
            id_file.write_text(json.dumps({"id": run_id}) + "\n")
        self.run = wandb.init(
            project=o.project, entity=o.entity, name=o.name or run.name, id=run_id, resume="allow",
            dir=str(run.run_dir), config=run.config, tags=o.tags or None,
            mode=o.mode or os.environ.get("WANDB_MODE") or None,
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, event: StepEvent) -> None:
        import wandb

        data: dict[str, Any] = dict(event.metrics)
        if self.options.images:
            for tag, path in event.images.items():
                data[tag] = wandb.Image(str(path))
        if self.options.histograms:
            for tag, values in event.histograms.items():
                finite = [v for v in values if math.isfinite(v)]
                if finite:
                    data[f"hist/{tag}"] = wandb.Histogram(finite)
        if self.options.audio:  # the WAV files as they are (wandb copies them into the run's media), a key each:
            for tag, clips in event.audio.items():  # a list under one key would need the soundfile package
                for n, clip in enumerate(clips[:self.options.audio_clips]):
                    data[f"{tag}/{n}"] = wandb.Audio(str(clip.path), caption=clip.caption)
        self.run.log(data, step=event.step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
