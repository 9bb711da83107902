"""Experiment trackers: plugins that watch a run (TensorBoard, W&B, ...). metrics.jsonl is always written;
trackers get the same rows besides it.

A tracker plugin registers a ``TrackerSpec`` through ``omnirl_register_trackers``; its factory takes the
validated options (``run.trackers.N.options``) and returns an ``omnirl_core.contracts.Tracker``:

  start(run: TrackerRun)     once, after the run directory is set up (and a checkpoint loaded, if any)
  log(event: StepEvent)      after each step's metrics row is written to metrics.jsonl (with the step's
                             pictures, per-sample rewards and speech samples, when it saved any)
  close()                    at the end of the run, whatever ended it

A resumed run starts at ``run.start_step``; rows of steps at or after it that an earlier attempt logged are
computed again, so a tracker that keeps its own history drops or overwrites them (TensorBoard: purge_step).
Whatever a tracker raises is logged as a warning and the run goes on: watching never fails training.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from omnirl_core.config import RunConfig, validate_options
from omnirl_core.contracts.runtime import Tracker
from omnirl_core.errors import ConfigError
from omnirl_core.registry import TrackerSpec

if TYPE_CHECKING:
    from omnirl_core.contracts import Sample
    from omnirl_core.plugins import PluginManager
    from omnirl_core.resolve import ResolvedRun

log = logging.getLogger("omnirl.trackers")
MAX_WARNINGS = 3
"""Warnings per tracker before its further failures are only counted."""


@dataclass
class TrackerRun:
    run_dir: Path
    name: str
    """A short name for the run (the run directory's name)."""
    config: dict[str, Any]
    """The resolved config, as config.yaml holds it (secrets redacted)."""
    start_step: int
    """The first step this invocation computes: 1, or the step after the checkpoint it resumed from."""

    @property
    def resumed(self) -> bool:
        return self.start_step > 1


@dataclass(frozen=True)
class AudioClip:
    """One speech sample the run directory keeps: a 16-bit PCM mono WAV file and its caption."""

    path: Path
    caption: str
    """The text spoken, with the sample's reward where it has one."""


@dataclass
class StepEvent:
    step: int
    metrics: dict[str, float]
    """The step's metrics row (numbers only; ``step`` left out)."""
    images: dict[str, Path] = field(default_factory=dict)
    """PNG files saved at this step, by tag: ``samples`` (the sample grid), ``eval/samples``."""
    histograms: dict[str, list[float]] = field(default_factory=dict)
    """Per-sample values, by tag: ``reward/total`` and ``reward/<name>``."""
    audio: dict[str, list[AudioClip]] = field(default_factory=dict)
    """Speech samples saved at this step as WAV files, by tag (as ``images``): ``samples``, ``eval/samples``."""


def saved_audio(listing: Path, folder: Path) -> list[AudioClip]:
    """The speech samples a JSONL listing names (``audio``: a WAV path relative to ``folder``), in its order:
    ``samples/step-N.jsonl`` of a run, an evaluation's ``<label>.jsonl``. When the listing is absent or names
    no audio (text outputs): an empty list; an unreadable one too, with a warning (watching never fails
    training)."""
    if not listing.is_file():
        return []
    clips = []
    try:
        records = [json.loads(line) for line in listing.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("the trackers get no audio of %s: %s", listing, exc)
        return []
    for record in records:
        if not isinstance(record, dict) or "audio" not in record:
            continue
        reward = record.get("reward")
        score = f" (reward {reward:.3f})" if isinstance(reward, (int, float)) and math.isfinite(reward) else ""
        clips.append(AudioClip(folder / record["audio"], f"{record.get('text') or record.get('prompt', '')}{score}"))
    return clips


def step_audio(run_dir: Path, step: int, samples: bool, evaluation: bool) -> dict[str, list[AudioClip]]:
    """The speech samples step ``step`` saved in ``run_dir``: its samples (``samples``: the step saved them, as
    it saves a grid) and its evaluation's (``evaluation``: the step evaluated), by tracker tag."""
    audio = {}
    name = f"step-{step:06d}"
    if samples:
        audio["samples"] = saved_audio(run_dir / "samples" / f"{name}.jsonl", run_dir / "samples")
    if evaluation:
        audio["eval/samples"] = saved_audio(run_dir / "eval" / name / "trained.jsonl", run_dir / "eval" / name)
    return {tag: clips for tag, clips in audio.items() if clips}


@dataclass
class ResolvedTracker:
    name: str
    spec: TrackerSpec
    options: BaseModel | None


def numeric(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row (``step`` left out); NaN stays NaN."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, str)}


def resolve_trackers(manager: PluginManager, config: RunConfig,
                     resolved: ResolvedRun | None = None) -> list[ResolvedTracker]:
    """Resolve ``run.trackers`` (an unknown name is a PluginError, bad options a ConfigError); with
    ``resolved`` (a ResolvedRun) the validated options join its dump, as every plugin's do."""
    out: list[ResolvedTracker] = []
    problems: list[str] = []
    names = [e.name for e in config.run.trackers]
    if len(set(names)) != len(names):
        raise ConfigError(f"A tracker is listed twice: {names}.", hint="Give each tracker once.")
    for i, entry in enumerate(config.run.trackers):
        spec = manager.resolve("tracker", entry.name)
        path = f"run.trackers.{i}.options"
        try:
            options = validate_options(entry.options, spec.load_config(), path)
        except ConfigError as err:
            problems += err.details or [err.message]
            continue
        if resolved is not None:
            resolved.options[path] = options
        out.append(ResolvedTracker(entry.name, spec, options))
    if problems:
        raise ConfigError(f"Invalid tracker options: {len(problems)} problem(s).", details=problems,
                          hint="See each tracker's options with `omnirl list trackers NAME --options`.")
    return out


class TrackerSet:
    """The run's trackers, each called in its own try block."""

    def __init__(self, trackers: list[ResolvedTracker]):
        self.pending = trackers
        self.active: list[tuple[str, Tracker]] = []
        self.failures: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.active or self.pending)

    def _failed(self, name: str, what: str, exc: BaseException) -> None:
        count = self.failures[name] = self.failures.get(name, 0) + 1
        if count <= MAX_WARNINGS:
            more = " (further failures of this tracker are not shown)" if count == MAX_WARNINGS else ""
            log.warning("tracker '%s' failed to %s: %s: %s; the run goes on%s", name, what, type(exc).__name__,
                        exc, more)

    def start(self, run: TrackerRun) -> None:
        for entry in self.pending:
            try:
                tracker = entry.spec.load_factory()(entry.options)
                if not isinstance(tracker, Tracker):
                    raise TypeError(f"built a {type(tracker).__name__}, not an omnirl_core.contracts.Tracker")
                tracker.start(run)
            except Exception as exc:  # noqa: BLE001 - a tracker never fails the run
                self._failed(entry.name, "start", exc)
                if isinstance(exc, ImportError):
                    log.warning("tracker '%s' needs %s: pip install %s", entry.name,
                                ", ".join(entry.spec.requires) or "its packages",
                                " ".join(entry.spec.requires) or f"omnirl-plugin-{entry.spec.plugin}")
                continue
            self.active.append((entry.name, tracker))
        self.pending = []

    def log(self, event: StepEvent) -> None:
        for name, tracker in self.active:
            try:
                tracker.log(event)
            except Exception as exc:  # noqa: BLE001 - a tracker never fails the run
                self._failed(name, f"log step {event.step}", exc)

    def close(self) -> None:
        for name, tracker in self.active:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 - a tracker never fails the run
                self._failed(name, "close", exc)
        self.active = []


def step_event(step: int, record: dict[str, Any], samples: list[Sample], reward_names: list[str],
               images: dict[str, Path], audio: dict[str, list[AudioClip]] | None = None) -> StepEvent:
    """A tracker's view of one finished step."""
    histograms: dict[str, list[float]] = {}
    totals = [s.reward for s in samples if isinstance(s.reward, float) and math.isfinite(s.reward)]
    if totals:
        histograms["reward/total"] = totals
    for name in reward_names:
        values = [s.rewards[name] for s in samples if name in s.rewards]
        if values:
            histograms[f"reward/{name}"] = values
    return StepEvent(step=step, metrics=numeric(record), images=images, histograms=histograms, audio=audio or {})
