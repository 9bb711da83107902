"""A checkpoint's workers' files in a storage location of the user's (``run.storage``) instead of the run directory.

With ``run.storage`` set (a local path every node mounts at the same place, or an fsspec URI: ``s3://bucket/runs/x``,
``gs://...``, ``file:///mnt/shared/x``), each train rank writes its part of a checkpoint (shards, optimizer state;
rank 0 the gathered weights, the algorithm's state, the evaluation weights) straight to
``<storage>/checkpoints/step-N-<id>/``, in the layout it has in a run directory, with its own manifest
(``stored-checksums.json``).
The driver's ``checkpoints/step-N/`` then holds ``trainer_state.json``, ``metrics.jsonl`` and ``storage.json``:
where the stored part lives and every stored file's SHA-256 and size, itself under the checkpoint's
``checksums.json``. A resume checks that every stored file is there at its size (the driver), then each rank fetches
its part from the storage and checks each file's SHA-256 as it reads it: every stored file is read by some rank.

Each save goes into a directory of its own (``-<id>``: the checkpoint's temporary name), so a save never overwrites a
checkpoint a run directory refers to. A save that fails removes what it stored.

Local paths need no package; a URI needs fsspec and its scheme's package (``s3fs``, ``gcsfs``, ...), on the driver
and on every node. fsspec's ``memory://`` is one process's memory: the workers would not share it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from omnirl_core.errors import EXIT_USAGE, OmnirlError

STORAGE_FILE = "storage.json"
"""In a run directory's checkpoint: where its workers' files are stored, and their SHA-256 and size."""
STORED_MANIFEST = "stored-checksums.json"
"""In a stored directory: its files' SHA-256, so that it can be checked alone (not ``checksums.json``, which would make
it look like a whole checkpoint, with a trainer state and metrics, to a reader such as ``omnirl eval``)."""
CHUNK = 16 << 20
URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


class StorageError(OmnirlError):
    """``run.storage`` cannot be used here (a scheme's package missing, a location that cannot be written), or a
    stored file is missing or damaged: names the location."""

    exit_code = EXIT_USAGE


def is_uri(location: str) -> bool:
    return bool(URI.match(location))


def absolute(location: str) -> str:
    """``location`` as the workers must see it: a local path made absolute (the driver's working directory is not
    theirs), a URI as it is."""
    return location if is_uri(location) else str(Path(location).expanduser().resolve())


class Storage:
    """A storage location: a local path (plain file I/O) or an fsspec URI (fsspec's filesystem for its scheme)."""

    def __init__(self, location: str):
        self.location = location.rstrip("/") or "/"
        self.fs: Any = None
        self.root = self.location
        if not is_uri(location):
            if not Path(location).is_absolute():
                raise StorageError(f"run.storage={location} is a relative path; the workers' working directories are "
                                   "not the driver's.", hint="Give an absolute path (a mount every node has).")
            return
        scheme = location.split("://", 1)[0]
        try:
            from fsspec.core import url_to_fs  # type: ignore[import-untyped]
        except ImportError as exc:
            raise StorageError(f"run.storage={location} is a URI, which needs fsspec, and fsspec is not installed "
                               "here.", hint=f"pip install fsspec (and the package of the '{scheme}' scheme, e.g. "
                               "s3fs for s3://, gcsfs for gs://) on the driver and every node, or give a local "
                               "path that every node mounts.") from exc
        try:
            self.fs, self.root = url_to_fs(self.location)
        except (ImportError, ValueError) as exc:
            raise StorageError(f"run.storage={location}: fsspec cannot open the '{scheme}' scheme here: {exc}",
                               hint="Install the package fsspec names for it, on the driver and every node.") from exc
        self.root = str(self.root).rstrip("/") or "/"

    # -- names --------------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """The path of ``parts`` below the location, as its filesystem names it."""
        return "/".join([self.root, *parts]) if self.root != "/" else "/" + "/".join(parts)

    def url(self, *parts: str) -> str:
        """The location of ``parts`` below it, as messages name it (the URI or the path the user gave)."""
        return "/".join([self.location, *parts])

    # -- I/O ----------------------------------------------------------------------------------------
    def _open(self, path: str, mode: str) -> Any:
        if self.fs is None:
            return open(path, mode)
        return self.fs.open(path, mode)

    def _makedirs(self, path: str) -> None:
        if self.fs is None:
            os.makedirs(path, exist_ok=True)
        else:
            self.fs.makedirs(path, exist_ok=True)

    def put(self, source: Path, *parts: str) -> tuple[str, int]:
        """Copy the local file ``source`` to ``parts`` below the location; (its SHA-256, its size) as read."""
        target = self.path(*parts)
        self._makedirs(target.rsplit("/", 1)[0])
        digest, size = hashlib.sha256(), 0
        with open(source, "rb") as src, self._open(target, "wb") as out:
            for block in iter(lambda: src.read(CHUNK), b""):
                digest.update(block)
                size += len(block)
                out.write(block)
            if self.fs is None:
                out.flush()
                os.fsync(out.fileno())
        return digest.hexdigest(), size

    def write_bytes(self, data: bytes, *parts: str) -> None:
        target = self.path(*parts)
        self._makedirs(target.rsplit("/", 1)[0])
        with self._open(target, "wb") as out:
            out.write(data)

    def get(self, target: Path, sha256: str, *parts: str, manifest: str = "") -> int:
        """Copy ``parts`` below the location to the local file ``target``, checking its SHA-256 as it reads; the
        bytes. A missing file or one whose bytes differ is a ``StorageError`` naming it."""
        where = self.url(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, size = hashlib.sha256(), 0
        try:
            with self._open(self.path(*parts), "rb") as src, open(target, "wb") as out:
                for block in iter(lambda: src.read(CHUNK), b""):
                    digest.update(block)
                    size += len(block)
                    out.write(block)
        except FileNotFoundError as exc:
            raise StorageError(f"Stored checkpoint file {where} is missing.",
                               details=[f"The checkpoint's {manifest or STORAGE_FILE} lists it."],
                               hint=RESTORE_HINT) from exc
        if digest.hexdigest() != sha256:
            raise StorageError(f"Stored checkpoint file {where} is damaged: its SHA-256 is {digest.hexdigest()}, the "
                               f"checkpoint's {manifest or STORAGE_FILE} says {sha256}.", hint=RESTORE_HINT)
        return size

    def size(self, *parts: str) -> int | None:
        """A stored file's size, or None when it is not there."""
        path = self.path(*parts)
        try:
            if self.fs is None:
                return os.path.getsize(path) if os.path.isfile(path) else None
            return int(self.fs.size(path)) if self.fs.isfile(path) else None
        except (FileNotFoundError, OSError):
            return None

    def remove(self, *parts: str) -> None:
        """Remove a stored directory (a save that failed); what cannot be removed is left."""
        path = self.path(*parts)
        try:
            if self.fs is None:
                import shutil

                shutil.rmtree(path, ignore_errors=True)
            elif self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        except OSError:
            pass


RESTORE_HINT = ("Restore the file in the storage location (it is the checkpoint's only copy), or move the run "
                "directory's checkpoints/step-N away to resume from an earlier checkpoint.")


# -- the record in the run directory -------------------------------------------------------------------

def record(location: str, directory: str, files: dict[str, tuple[str, int]]) -> dict[str, Any]:
    """``storage.json``: the location, the stored directory below it, each file's SHA-256 and size."""
    return {"location": location, "directory": directory,
            "files": {name: {"sha256": sha, "size": size} for name, (sha, size) in sorted(files.items())}}


def stored_manifest(files: dict[str, tuple[str, int]]) -> bytes:
    """The stored directory's own manifest (``STORED_MANIFEST``, in ``checksums.json``'s format)."""
    return json.dumps({"sha256": {name: sha for name, (sha, _) in sorted(files.items())}}, indent=2).encode()


def missing_or_resized(entry: dict[str, Any]) -> list[str]:
    """The stored files of a checkpoint's ``storage.json`` entry that are not in the storage at their size (their
    SHA-256 is checked by the ranks that read them)."""
    storage = Storage(str(entry["location"]))
    directory = str(entry["directory"])
    problems = []
    for name, meta in sorted(entry["files"].items()):
        size = storage.size(directory, name)
        if size is None:
            problems.append(f"  {storage.url(directory, name)}: missing (run.storage)")
        elif size != int(meta["size"]):
            problems.append(f"  {storage.url(directory, name)}: {size} bytes, the checkpoint recorded {meta['size']} "
                            "(damaged or changed after saving)")
    return problems


def fetch(entry: dict[str, Any], names: list[str], into: Path, manifest: str = "") -> int:
    """Copy the stored files ``names`` of a checkpoint's ``storage.json`` entry into the local directory ``into``,
    each checked against its SHA-256; the bytes. (A worker's part on resume; or all of them, to read a stored
    checkpoint's weights on one machine.)"""
    storage = Storage(str(entry["location"]))
    directory = str(entry["directory"])
    moved = 0
    for name in names:
        parts = Path(name).parts
        if Path(name).is_absolute() or ".." in parts or not parts:
            raise StorageError(f"refusing stored checkpoint file name {name!r}: not a path inside the checkpoint")
        moved += storage.get(into / name, str(entry["files"][name]["sha256"]), directory, name, manifest=manifest)
    return moved
