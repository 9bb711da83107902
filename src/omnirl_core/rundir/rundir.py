"""The run directory: resolved config, plugin lock, metrics.jsonl, sample grids, reward curve; a lock while a
run uses it."""

from __future__ import annotations

import fcntl
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from omnirl_core.errors import ConfigError, UsageError

if TYPE_CHECKING:
    from PIL import Image
from omnirl_core.rundir.checkpoint import write_atomic

CONFIG_FILE = "config.yaml"
LOCK_FILE = "plugins.lock.json"
METRICS_FILE = "metrics.jsonl"
RUN_LOCK = ".omnirl.lock"
RUNTIME_FILE = "runtime.json"
_HELD: dict[Path, int] = {}  # run directories this process holds (flock is per open file, not per process)
# keys that may differ between invocations of one run (a resumed run may train longer)
RUN_IDENTITY_IGNORES = (
    "run.steps", "run.output_dir", "run.save_every", "run.sample_every",
    # placement changes where workers run, not what they compute: a run may resume on another executor
    "run.executor", "run.ray_address", "run.ray_pools", "run.storage", "run.placement", "run.worker_cpus", "run.reward_mode",
    "run.reward_workers", "run.reward_serving", "run.reward_serve",  # actors or Ray Serve: the same scores, bit for bit
    "run.reference", "run.rollout_threads", "run.reward_concurrency", "run.threads",
    # deadlines and patience: how long to wait for a reward, not what it computes
    "run.reward_timeout_s", "run.reward_max_failed_steps",
    # what watches a run, not what it computes: trackers and the evaluation cadence may change on a resume
    "run.trackers", "run.eval_every",
)


def _without(config: dict[str, Any], dotted: tuple[str, ...]) -> dict[str, Any]:
    out = json.loads(json.dumps(config))
    for key in dotted:
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.get(part, {})
        node.pop(parts[-1], None)
    return out


def config_differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Keys whose values differ between the saved config ``a`` and the current one ``b`` (a key on one side
    only is a difference too: the run would not compute what it computed before)."""
    diffs = []
    for key in sorted(set(a) | set(b)):
        path = f"{prefix}{key}"
        if key not in a or key not in b:
            diffs.append(f"{path}: {a[key]!r} (saved) vs absent (now)" if key in a
                         else f"{path}: absent (saved) vs {b[key]!r} (now)")
            continue
        va, vb = a[key], b[key]
        if isinstance(va, dict) and isinstance(vb, dict):
            diffs += config_differences(va, vb, path + ".")
        elif va != vb:
            diffs.append(f"{path}: {va!r} (saved) vs {vb!r} (now)")
    return diffs


class RunDir:
    def __init__(self, path: Path):
        self.path = path
        self.samples = path / "samples"

    # -- lock ----------------------------------------------------------------------------------
    def lock(self) -> None:
        """Hold the directory for this process until ``unlock`` or exit (kill -9 included: the kernel drops
        the lock with the process). A second run on the same directory is refused."""
        self.path.mkdir(parents=True, exist_ok=True)
        key = self.path.resolve()
        if key in _HELD:
            return
        fd = os.open(self.path / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UsageError(f"Run directory '{self.path}' is in use by another omnirl process (pid {owner}).",
                             hint="Wait for that run to end or stop it, or use another --output-dir.") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _HELD[key] = fd

    def unlock(self) -> None:
        fd = _HELD.pop(self.path.resolve(), None)
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def check(self, config: dict[str, Any]) -> None:
        """Refuse a directory that is not an omnirl run or holds a different run."""
        if self.is_foreign():
            raise ConfigError(f"Output directory '{self.path}' is not empty and holds no omnirl run.",
                              hint="Pick another --output-dir.")
        diffs = self.differences(config)
        if diffs:
            raise ConfigError(
                f"Output directory '{self.path}' holds a different run.",
                details=["Differences:", *(f"  {d}" for d in diffs[:10])],
                hint="Use another --output-dir, or rerun with the same settings to resume that run.",
            )

    def claim(self, config: dict[str, Any], plugins: list[dict[str, Any]]) -> bool:
        """Take the directory for a run: lock it, check it again (under the lock), clean what interrupted
        writes left, write the config. Returns whether a checkpoint exists to resume from."""
        from omnirl_core.rundir.checkpoint import clean_partial, latest_checkpoint

        self.lock()
        self.check(config)
        clean_partial(self.path)
        self.prepare(config, plugins)
        return latest_checkpoint(self.path) is not None

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    def saved_config(self) -> dict[str, Any] | None:
        if not self.config_path.is_file():
            return None
        return yaml.safe_load(self.config_path.read_text())

    def differences(self, config: dict[str, Any]) -> list[str]:
        """Conflicts between the saved run's config and ``config`` (keys that may change between
        invocations left out)."""
        saved = self.saved_config()
        if saved is None:
            return []
        return config_differences(_without(saved, RUN_IDENTITY_IGNORES), _without(config, RUN_IDENTITY_IGNORES))

    def is_foreign(self) -> bool:
        """A non-empty directory that is not an omnirl run."""
        return (self.path.is_dir() and any(p.name != RUN_LOCK for p in self.path.iterdir())
                and not self.config_path.is_file())

    def prepare(self, config: dict[str, Any], lock: list[dict[str, Any]]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.samples.mkdir(exist_ok=True)
        write_atomic(self.config_path, yaml.safe_dump(config, sort_keys=False))
        write_atomic(self.path / LOCK_FILE, json.dumps(lock, indent=2) + "\n")

    def save_runtime(self, info: dict[str, Any]) -> None:
        """How this invocation runs (the thread policy, ...): facts of the machine, not of the run's identity;
        rewritten by each invocation."""
        write_atomic(self.path / RUNTIME_FILE, json.dumps(info, indent=2) + "\n")

    # -- metrics -------------------------------------------------------------------------------
    # One row per finished step, appended (and fsynced) as the run goes so it can be watched. Every
    # checkpoint keeps a copy of the rows up to its step; a resume puts that copy back, so rows of steps
    # after the checkpoint (which the resumed run computes again) never stay twice.
    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.path / METRICS_FILE, "a") as fh:
            fh.write(json.dumps(record, allow_nan=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def metrics_bytes(self) -> bytes:
        """metrics.jsonl as saved, without a torn last line."""
        path = self.path / METRICS_FILE
        data = path.read_bytes() if path.is_file() else b""
        return data[:data.rfind(b"\n") + 1]

    def restore_metrics(self, data: bytes) -> None:
        """Make metrics.jsonl exactly ``data`` (a checkpoint's copy, or empty for a run that starts over)."""
        write_atomic(self.path / METRICS_FILE, data)

    def read_metrics(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.metrics_bytes().decode().splitlines() if line.strip()]

    # -- images --------------------------------------------------------------------------------
    def save_grid(self, step: int, images: list[Any], prompts: list[str], columns: int,
                  rewards: list[float] | None = None, sources: list[tuple[str, ...]] | None = None) -> Path:
        """A PNG grid of images / video frame strips (videos also as an animated GIF grid beside it); text
        outputs go to a JSONL file instead, speech to WAV files listed in one. ``sources``: each image's condition images (an edit's source), shown
        at the start of its row."""
        from omnirl_core.contracts.data import Speech
        from omnirl_core.rundir.pictures import image_grid, is_video, video_grid_gif

        if images and all(isinstance(x, Speech) for x in images):
            return self._save_speech(step, images, prompts, rewards)
        if images and all(isinstance(x, str) for x in images):
            path = self.samples / f"step-{step:06d}.jsonl"
            scores = rewards if rewards is not None else [None] * len(images)
            lines = [json.dumps({"prompt": p, "output": o, "reward": r}, ensure_ascii=False)
                     for p, o, r in zip(prompts, images, scores)]
            write_atomic(path, "\n".join(lines) + "\n")
            return path
        path = self.samples / f"step-{step:06d}.png"
        _save_png(image_grid(images, prompts, columns, sources), path)
        if images and all(is_video(x) for x in images):
            video_grid_gif(images, prompts, columns, path.with_suffix(".gif"))
        return path

    def _save_speech(self, step: int, speeches: list[Any], prompts: list[str], rewards: list[float] | None) -> Path:
        """Speech outputs: one WAV file each under ``samples/step-N/`` and ``samples/step-N.jsonl`` naming them."""
        from omnirl_core.rundir.audio import write_wav

        folder = self.samples / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        scores = rewards if rewards is not None else [None] * len(speeches)
        lines = []
        for n, (speech, prompt, reward) in enumerate(zip(speeches, prompts, scores)):
            wav = write_wav(folder / f"{n:03d}.wav", speech)
            lines.append(json.dumps({"prompt": prompt, "text": speech.text, "audio": f"{folder.name}/{wav.name}",
                                     "seconds": round(speech.duration_s, 3), "reward": reward}, ensure_ascii=False))
        path = self.samples / f"step-{step:06d}.jsonl"
        write_atomic(path, "\n".join(lines) + "\n")
        return path

    def plot_rewards(self) -> Path | None:
        from omnirl_core.rundir.pictures import reward_curve

        records = [r for r in self.read_metrics() if math.isfinite(r.get("reward/mean", float("nan")))]
        if not records:
            return None
        path = self.path / "reward_curve.png"
        _save_png(reward_curve(records), path)
        return path


def _save_png(image: Image.Image, path: Path) -> None:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    write_atomic(path, buffer.getvalue())
