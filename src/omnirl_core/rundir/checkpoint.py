"""Checkpoints: their directories, manifest and checksums. Safetensors and JSON only (no pickle). Each component
writes and reads its own files (``TrainEngine.save_state``, ``Algorithm.save_checkpoint``; the worker gathers
them, ``omnirl_core.loop.worker``); this module lays out the directory around them.

Layout of ``<run>/checkpoints/step-000020/``:
  pytorch_lora_weights.safetensors | transformer/   trained weights, in the layout diffusers reads (the model's)
  optimizer.safetensors, optimizer.json             optimizer tensors (flattened) and their metadata (the train
                                                    engine's; a sharded engine writes ``shards/`` instead)
  algorithm.json, algorithm.safetensors             the algorithm's own state (optional)
  eval-weights/                                     the weights the algorithm evaluates, when they are not the
                                                    trained ones (FlowGRPO's EMA): what `omnirl eval` loads
  trainer_state.json                                step, the files the components wrote, the controller's state
  metrics.jsonl                                     the run's metrics rows 1..step, byte for byte
  storage.json                                      with ``run.storage``: where the workers' files above are stored
                                                    (instead of here) and their SHA-256 and size
                                                    (``omnirl_core.rundir.storage``)
  checksums.json                                    SHA-256 of every file above; written last

The protocol: a checkpoint is written into a hidden temporary directory, every file is fsynced, the
manifest (``checksums.json``) is written last, and the directory is renamed to ``step-N`` in one atomic
step. So a directory named ``step-N`` is complete, whatever moment a crash came; resuming takes the newest
one (``latest`` names it too, for people and tools, but is not needed), verifies every checksum, and
restores metrics.jsonl from the checkpoint's own copy: a resumed run never duplicates or loses a row.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omnirl_core.errors import EXIT_USAGE, OmnirlError

CHECKSUMS = "checksums.json"
TRAINER_STATE = "trainer_state.json"
METRICS_COPY = "metrics.jsonl"
TMP_PREFIX = ".tmp-step-"
STEP_DIR = re.compile(r"step-(\d{6,})")


class CheckpointError(OmnirlError):
    """A checkpoint that cannot be trusted or read: names the file and says how to go on."""

    exit_code = EXIT_USAGE  # bad input on disk: the user decides (move it away, start over)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write a file so that readers see the old content or the new one, never a torn one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def read_json(path: Path) -> Any:
    """A JSON file of a checkpoint; a truncated or broken one is a CheckpointError naming it."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"Cannot read {path}: {exc}",
                              hint="The checkpoint is damaged; see `checkpoints/` for an earlier one.") from exc


# -- save / load -----------------------------------------------------------------------------------

def save_checkpoint(run_dir: Path, step: int, write_state: Callable[[Path], list[str]], extra: dict[str, Any],
                    metrics: bytes) -> Path:
    """Write checkpoint ``step``: ``write_state(directory)`` writes the workers' files (weights, optimizer,
    algorithm state; every rank its shard) and returns their names; ``extra`` goes to trainer_state.json;
    ``metrics`` is the run's metrics.jsonl up to this step."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{step:06d}-", dir=root))
    try:
        files = write_state(tmp)
        (tmp / TRAINER_STATE).write_text(json.dumps({"step": step, "files": files, **extra}, indent=2))
        (tmp / METRICS_COPY).write_bytes(metrics)
        sums = {}
        for name in _files(tmp):
            _fsync(tmp / name)
            sums[name] = sha256(tmp / name)
        (tmp / CHECKSUMS).write_text(json.dumps({"sha256": sums}, indent=2))
        _fsync(tmp / CHECKSUMS)
        if final.exists():  # a step saved again (after a resume from an earlier checkpoint)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    write_atomic(root / "latest", final.name + "\n")
    return final


def clean_partial(run_dir: Path) -> list[str]:
    """Remove what interrupted writes left behind: temporary checkpoint directories, and the temporary
    files of ``write_atomic`` beside the run's own files. Call it only while holding the run's lock."""
    removed = []
    targets = {run_dir: ("config.yaml", "plugins.lock.json", "metrics.jsonl", "runtime.json", "reward_curve.png"),
               run_dir / "checkpoints": ("latest",), run_dir / "samples": ()}
    for parent, names in targets.items():
        if not parent.is_dir():
            continue
        for path in parent.iterdir():
            partial_file = path.is_file() and (path.name.startswith(tuple(f".{n}-" for n in names))
                                               or (parent.name == "samples" and path.name.startswith(".step-")))
            if path.name.startswith(TMP_PREFIX) or partial_file:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
                removed.append(str(path.relative_to(run_dir)))
    return removed


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (``step-N`` directories), oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = STEP_DIR.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint. Completeness comes from the atomic rename, so a missing or stale
    ``latest`` pointer loses nothing."""
    found = checkpoints(run_dir)
    return found[-1][1] if found else None


def stored_name(directory: Path) -> str:
    """The name of a checkpoint's stored part (``run.storage``) from the temporary directory ``save_checkpoint`` hands
    the workers: ``step-N-<id>``, a directory of its own for each save."""
    return "step-" + directory.name.removeprefix(TMP_PREFIX)


def stored_entry(path: Path) -> dict[str, Any] | None:
    """A checkpoint's ``storage.json`` (its workers' files are in ``run.storage``), or None."""
    from omnirl_core.rundir.storage import STORAGE_FILE

    file = path / STORAGE_FILE
    return read_json(file) if file.is_file() else None


def fallback_hint(path: Path) -> str:
    """How to go on when checkpoint ``path`` is damaged: the checkpoint before it, or a new run."""
    earlier = [p.name for _, p in checkpoints(path.parent.parent) if p.name < path.name]
    return (f"Move '{path}' away to resume from {earlier[-1]}, or start a new run."
            if earlier else "Start a new run (--output-dir) or remove the damaged checkpoint.")


def verify(path: Path) -> dict[str, Any]:
    """Check a checkpoint against its manifest; returns trainer_state.json. Every file in the directory must be in
    the manifest and match its checksum, and the manifest must hold what the format requires: the trainer state,
    the metrics copy, and every path the components listed as written (``trainer_state.json``'s ``files``). A
    checkpoint whose workers' files are in ``run.storage`` (``storage.json``): each stored file must be there at its
    recorded size; the ranks that read them check their SHA-256."""
    fallback = fallback_hint(path)
    manifest_path = path / CHECKSUMS
    if not manifest_path.is_file():
        raise CheckpointError(f"Checkpoint {path} has no {CHECKSUMS}: it was not written by omnirl's checkpoint "
                              "protocol, or the file was removed.", hint=fallback)
    try:
        sums = json.loads(manifest_path.read_text())["sha256"]
        if not isinstance(sums, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items()):
            raise TypeError("'sha256' is not a map of file names to checksums")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"Cannot read {manifest_path}: {exc}", hint=fallback) from exc
    problems = []
    for name, expected in sorted(sums.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"  {file}: missing")
        elif sha256(file) != expected:
            problems.append(f"  {file}: content differs from its checksum (damaged or changed after saving)")
    unlisted = [name for name in _files(path) if name != CHECKSUMS and name not in sums]
    problems += [f"  {path / name}: not in {CHECKSUMS} (added after saving, or the manifest was cut)"
                 for name in unlisted]
    problems += [f"  {path / name}: required, but not in {CHECKSUMS}" for name in (TRAINER_STATE, METRICS_COPY)
                 if name not in sums]
    stored: dict[str, Any] = {}
    if not problems:  # storage.json is verified now: the stored files must be there
        from omnirl_core.rundir.storage import missing_or_resized

        entry = stored_entry(path)
        if entry is not None:
            try:
                stored = dict(entry["files"])
                problems += missing_or_resized(entry)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                problems.append(f"  {path / 'storage.json'}: cannot be read ({type(exc).__name__}: {exc})")
    if not problems:  # trainer_state.json is verified now: the files the components wrote must be listed
        written = read_json(path / TRAINER_STATE).get("files", [])
        for name in written if isinstance(written, list) else []:
            listed = (any(k.startswith(name) for k in [*sums, *stored]) if str(name).endswith("/")
                      else name in sums or name in stored)
            if not listed:
                problems.append(f"  {path / name}: written by a component, but not in {CHECKSUMS}")
    if problems:
        raise CheckpointError(f"Checkpoint {path} is damaged: {len(problems)} problem(s) with its files.",
                              details=problems, hint=fallback)
    return read_json(path / TRAINER_STATE)


def load_checkpoint(path: Path, read_state: Callable[[Path], None]) -> dict[str, Any]:
    """Verify a checkpoint, then ``read_state(directory)`` loads the workers' files; returns its state."""
    state = verify(path)
    try:
        read_state(path)
    except OmnirlError:
        raise
    except Exception as exc:
        entry = stored_entry(path)
        if entry is not None:
            raise CheckpointError(f"Cannot load checkpoint {path}: its workers' files are stored in "
                                  f"{entry.get('location')} (run.storage), which this executor does not read: "
                                  f"{type(exc).__name__}: {exc}",
                                  hint="Resume with --executor ray (its workers fetch their part from the "
                                  "storage).") from exc
        raise CheckpointError(f"Cannot load checkpoint {path}: {type(exc).__name__}: {exc}",
                              hint="Its files passed verification, so this omnirl or plugin version reads them "
                              "differently; check `plugins.lock.json` for the versions that wrote it.") from exc
    return state


def metrics_copy(path: Path) -> bytes:
    """The metrics rows a checkpoint saved (verified with it)."""
    file = path / METRICS_COPY
    return file.read_bytes() if file.is_file() else b""
