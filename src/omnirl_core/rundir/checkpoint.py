"""Checkpoints: the one place that defines their format. Safetensors and JSON only (no pickle).

Layout of ``<run>/checkpoints/step-000020/``:
  pytorch_lora_weights.safetensors | transformer/   trained weights, in the layout diffusers reads
  optimizer.safetensors, optimizer.json             optimizer tensors (flattened) and their metadata
  algorithm.json, algorithm.safetensors             the algorithm's own state (optional)
  eval-weights/                                     the weights the algorithm evaluates, when they are not the
                                                    trained ones (FlowGRPO's EMA): what `omnirl eval` loads
  trainer_state.json                                step, the files, the controller's extra state
  metrics.jsonl                                     the run's metrics rows 1..step, byte for byte
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
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
ALGORITHM_STATE = "algorithm.json"
ALGORITHM_TENSORS = "algorithm.safetensors"
EVAL_WEIGHTS = "eval-weights"
STEP_DIR = re.compile(r"step-(\d{6,})")


class CheckpointError(OmnirlError):
    """A checkpoint that cannot be trusted or read: names the file and says how to go on."""

    exit_code = EXIT_USAGE  # bad input on disk: the user decides (move it away, start over)


def optimizer_to_tensors(optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split an optimizer state into tensors (for safetensors) and JSON-able metadata; no pickle."""
    import torch

    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, pstate in state["state"].items():
        for key, value in pstate.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def optimizer_from_tensors(optimizer: Any, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        pid, _, key = name.partition(".")
        state.setdefault(int(pid), {})[key] = value
    for pid, values in meta.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(values)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


# -- files -----------------------------------------------------------------------------------------

def save_worker_files(directory: Path, model: Any, trainer: Any, algorithm: Any, rank: int) -> list[str]:
    """A train worker's part of a checkpoint: the trained weights in the layout diffusers / peft read (rank 0),
    the optimizer (rank 0; a sharded engine (``trainer.sharded``) writes every rank's shard itself), and the
    algorithm's own state (rank 0: an EMA sampler policy, a reference snapshot)."""
    from safetensors.torch import save_file

    from omnirl_core.weights import export_trained_state

    files: list[str] = []
    if getattr(trainer, "sharded", False):
        files = trainer.save_shards(directory)  # a collective: every rank
        full = export_trained_state(model, trainer)
        if rank == 0:
            files += model.save_trained(directory, state=full)
    elif rank == 0:
        files = model.save_trained(directory)
        tensors, meta = optimizer_to_tensors(trainer.optimizer)
        save_file(tensors, str(directory / OPTIMIZER_TENSORS))
        (directory / OPTIMIZER_META).write_text(json.dumps(meta))
        files += [OPTIMIZER_TENSORS, OPTIMIZER_META]
    if algorithm is not None and algorithm.has_eval_policy:  # e.g. an EMA of the trained weights
        with algorithm.eval_policy(model):
            if getattr(trainer, "sharded", False):
                full = export_trained_state(model, trainer)  # a collective: every rank
                written = model.save_trained(directory / EVAL_WEIGHTS, state=full) if rank == 0 else []
            else:
                written = model.save_trained(directory / EVAL_WEIGHTS) if rank == 0 else []
        files += [f"{EVAL_WEIGHTS}/{name}" for name in written]
    if rank == 0 and algorithm is not None:
        state = algorithm.state()
        if state:
            (directory / ALGORITHM_STATE).write_text(json.dumps(state, indent=2))
            files.append(ALGORITHM_STATE)
        tensors = algorithm.state_tensors()
        if tensors:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                      str(directory / ALGORITHM_TENSORS))
            files.append(ALGORITHM_TENSORS)
    return files


def load_worker_files(directory: Path, model: Any, trainer: Any, algorithm: Any) -> None:
    """Load what ``save_worker_files`` wrote (``verify`` has checked every file). A worker without a trainer
    (a rollout worker) loads the trained weights only."""
    from safetensors.torch import load_file

    if getattr(trainer, "sharded", False):
        trainer.load_shards(directory)
    else:
        model.load_trained(directory)
        if trainer is not None and (directory / OPTIMIZER_TENSORS).is_file():
            optimizer_from_tensors(trainer.optimizer, load_file(str(directory / OPTIMIZER_TENSORS)),
                                   read_json(directory / OPTIMIZER_META))
    if trainer is None or algorithm is None:
        return
    if (directory / ALGORITHM_STATE).is_file():
        algorithm.load_state(read_json(directory / ALGORITHM_STATE))
    if (directory / ALGORITHM_TENSORS).is_file():
        algorithm.load_state_tensors(load_file(str(directory / ALGORITHM_TENSORS)), model)


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


def verify(path: Path) -> dict[str, Any]:
    """Check every file of a checkpoint against its manifest; returns trainer_state.json."""
    earlier = [p.name for _, p in checkpoints(path.parent.parent) if p.name < path.name]
    fallback = (f"Move '{path}' away to resume from {earlier[-1]}, or start a new run."
                if earlier else "Start a new run (--output-dir) or remove the damaged checkpoint.")
    manifest_path = path / CHECKSUMS
    if not manifest_path.is_file():
        raise CheckpointError(f"Checkpoint {path} has no {CHECKSUMS}: it was not written by omnirl's checkpoint "
                              "protocol, or the file was removed.", hint=fallback)
    try:
        sums = json.loads(manifest_path.read_text())["sha256"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"Cannot read {manifest_path}: {exc}", hint=fallback) from exc
    problems = []
    for name, expected in sorted(sums.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"  {file}: missing")
        elif sha256(file) != expected:
            problems.append(f"  {file}: content differs from its checksum (damaged or changed after saving)")
    if problems:
        raise CheckpointError(f"Checkpoint {path} is damaged: {len(problems)} file(s) fail verification.",
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
        raise CheckpointError(f"Cannot load checkpoint {path}: {type(exc).__name__}: {exc}",
                              hint="Its files passed verification, so this omnirl or plugin version reads them "
                              "differently; check `plugins.lock.json` for the versions that wrote it.") from exc
    return state


def metrics_copy(path: Path) -> bytes:
    """The metrics rows a checkpoint saved (verified with it)."""
    file = path / METRICS_COPY
    return file.read_bytes() if file.is_file() else b""
