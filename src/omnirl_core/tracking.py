"""The run directory: resolved config, plugin lock, metrics.jsonl, sample grids, reward curve."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

CONFIG_FILE = "config.yaml"
LOCK_FILE = "plugins.lock.json"
METRICS_FILE = "metrics.jsonl"
# keys that may differ between invocations of one run (a resumed run may train longer)
RUN_IDENTITY_IGNORES = (
    "run.steps", "run.output_dir", "run.save_every", "run.sample_every", "run.log_every",
    # placement changes where workers run, not what they compute: a run may resume on another executor
    "run.executor", "run.ray_address", "run.placement", "run.worker_cpus", "run.reward_mode", "run.reward_workers",
    "run.reference", "run.rollout_threads", "run.reward_concurrency",
)


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _without(config: dict[str, Any], dotted: tuple[str, ...]) -> dict[str, Any]:
    out = json.loads(json.dumps(config))
    for key in dotted:
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.get(part, {})
        node.pop(parts[-1], None)
    return out


def config_differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "",
                       one_sided: list[str] | None = None) -> list[str]:
    """Keys whose values differ between the saved config ``a`` and the current one ``b``.

    A key present on one side only (an option a newer omnirl or plugin version added, or one it dropped)
    is no conflict: the saved run simply predates it. Such keys go to ``one_sided`` when given."""
    diffs = []
    for key in sorted(set(a) | set(b)):
        path = f"{prefix}{key}"
        if key not in a or key not in b:
            if one_sided is not None:
                side = "now" if key in b else "saved"
                one_sided.append(f"{path}: {(b if key in b else a)[key]!r} ({side} only)")
            continue
        va, vb = a[key], b[key]
        if isinstance(va, dict) and isinstance(vb, dict):
            diffs += config_differences(va, vb, path + ".", one_sided)
        elif va != vb:
            diffs.append(f"{path}: {va!r} (saved) vs {vb!r} (now)")
    return diffs


class RunDir:
    def __init__(self, path: Path):
        self.path = path
        self.samples = path / "samples"

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    def saved_config(self) -> dict[str, Any] | None:
        if not self.config_path.is_file():
            return None
        return yaml.safe_load(self.config_path.read_text())

    def differences(self, config: dict[str, Any], one_sided: list[str] | None = None) -> list[str]:
        """Conflicts between the saved run's config and ``config`` (keys that may change between
        invocations left out); options only one side knows are collected in ``one_sided``."""
        saved = self.saved_config()
        if saved is None:
            return []
        return config_differences(_without(saved, RUN_IDENTITY_IGNORES), _without(config, RUN_IDENTITY_IGNORES),
                                  one_sided=one_sided)

    def is_foreign(self) -> bool:
        """A non-empty directory that is not an omnirl run."""
        return self.path.is_dir() and any(self.path.iterdir()) and not self.config_path.is_file()

    def prepare(self, config: dict[str, Any], lock: list[dict[str, Any]]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.samples.mkdir(exist_ok=True)
        _atomic_write(self.config_path, yaml.safe_dump(config, sort_keys=False))
        _atomic_write(self.path / LOCK_FILE, json.dumps(lock, indent=2) + "\n")

    # -- metrics -------------------------------------------------------------------------------
    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.path / METRICS_FILE, "a") as fh:
            fh.write(json.dumps(record, allow_nan=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def read_metrics(self) -> list[dict[str, Any]]:
        path = self.path / METRICS_FILE
        if not path.is_file():
            return []
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line from a crash
        return records

    def truncate_metrics(self, last_step: int) -> None:
        kept = [r for r in self.read_metrics() if r.get("step", 0) <= last_step]
        _atomic_write(self.path / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in kept))

    # -- images --------------------------------------------------------------------------------
    def save_grid(self, step: int, images: list[Any], prompts: list[str], columns: int,
                  rewards: list[float] | None = None) -> Path:
        """A PNG grid of images / video frame strips (videos also as an animated GIF grid beside it); text
        outputs go to a JSONL file instead."""
        from omnirl_core.visual import image_grid, is_video, video_grid_gif

        if images and all(isinstance(x, str) for x in images):
            path = self.samples / f"step-{step:06d}.jsonl"
            scores = rewards if rewards is not None else [None] * len(images)
            lines = [json.dumps({"prompt": p, "output": o, "reward": r}, ensure_ascii=False)
                     for p, o, r in zip(prompts, images, scores)]
            _atomic_write(path, "\n".join(lines) + "\n")
            return path
        path = self.samples / f"step-{step:06d}.png"
        image_grid(images, prompts, columns).save(path)
        if images and all(is_video(x) for x in images):
            video_grid_gif(images, prompts, columns, path.with_suffix(".gif"))
        return path

    def plot_rewards(self) -> Path | None:
        from omnirl_core.visual import reward_curve

        records = [r for r in self.read_metrics() if math.isfinite(r.get("reward/mean", float("nan")))]
        if not records:
            return None
        path = self.path / "reward_curve.png"
        reward_curve(records).save(path)
        return path
