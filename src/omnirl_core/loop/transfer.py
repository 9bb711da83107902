"""A worker's checkpoint files over Ray, for clusters without a shared disk.

A worker writes its part of a checkpoint into a scratch directory of its own node and streams it to the driver in
chunks (a Ray streaming generator: each chunk an object, at most ``IN_FLIGHT`` of them ahead of the driver); the
driver writes them into the checkpoint's temporary directory and checks each file's SHA-256 against the one the
worker computed, before the checkpoint protocol (``omnirl_core.rundir.checkpoint``) fsyncs, checksums and renames
it as it does any checkpoint. A resume sends each worker its part back the same way round: the driver puts the
files in Ray's object store in chunks, the worker fetches them into its scratch directory, checks them and loads.

A worker's part: every file of the checkpoint, except the files of other ranks of a sharded engine when the world
size is the one that wrote them. Such a file is named ``rank-RRRRR-of-WWWWW.<ext>`` (``rank_file``); an engine that
reshards (another world size) gets every rank's.

With ``run.storage`` (``omnirl_core.rundir.storage``) the workers' files go to the storage instead, in two calls: each
worker writes its part into a scratch directory and lists each file's SHA-256 (``digest``); the driver picks one
worker for each file (``owners``: a file several ranks wrote must have the same bytes on each), and each worker copies
its own to the storage. Nothing passes through the driver.

No worker ever opens a path of the driver's run directory.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

CHUNK = 16 << 20
"""Bytes per chunk: large enough that a chunk costs little overhead, small enough to bound memory."""
IN_FLIGHT = 8
"""Chunks a worker's stream may run ahead of the driver (Ray's generator backpressure): its memory bound."""
RANK_FILE = re.compile(r"(?:^|/)rank-(\d+)-of-(\d+)\.[^/]+$")


@dataclass
class Chunk:
    """A piece of one file; the last piece of a file (``last``) carries its size and SHA-256."""

    name: str
    data: bytes
    last: bool
    sha256: str = ""
    size: int = 0


class TransferError(RuntimeError):
    """A file whose bytes arrived other than they were sent (a checksum that differs, a path outside the
    checkpoint)."""


def safe_name(name: str) -> str:
    """A checkpoint file's relative name, refused when it would leave the checkpoint's directory."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise TransferError(f"refusing checkpoint file name {name!r}: not a path inside the checkpoint")
    return str(path)


def files_in(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory).as_posix()) for p in directory.rglob("*") if p.is_file())


def chunks_of(directory: Path) -> Iterator[Chunk]:
    """Every file below ``directory`` as chunks, in name order."""
    for name in files_in(directory):
        digest, size = hashlib.sha256(), 0
        with open(directory / name, "rb") as fh:
            block = fh.read(CHUNK)
            while True:
                following = fh.read(CHUNK) if block else b""
                digest.update(block)
                size += len(block)
                if not following:
                    yield Chunk(name, block, True, digest.hexdigest(), size)
                    break
                yield Chunk(name, block, False)
                block = following


def digest(path: Path) -> tuple[str, int]:
    """A file's SHA-256 and size."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            sha.update(block)
            size += len(block)
    return sha.hexdigest(), size


def owners(parts: list[dict[str, tuple[str, int]]]) -> list[list[str]]:
    """Which worker stores which file: ``parts[rank]`` is what that rank wrote (name -> SHA-256, size); each file goes
    from the lowest rank that has it. A file two ranks wrote with different bytes is a ``TransferError``."""
    first: dict[str, tuple[int, str]] = {}
    out: list[list[str]] = [[] for _ in parts]
    for rank, files in enumerate(parts):
        for name, (sha, _) in sorted(files.items()):
            safe_name(name)
            if name not in first:
                first[name] = (rank, sha)
                out[rank].append(name)
            elif first[name][1] != sha:
                raise TransferError(f"ranks {first[name][0]} and {rank} wrote checkpoint file {name} with different "
                                    "contents")
    return out


@contextmanager
def scratch(prefix: str = "omnirl-ckpt-") -> Iterator[Path]:
    """A directory of this node's own, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Receiver:
    """The driver's side of saving: writes the chunks of the workers' streams into ``directory``. A file that two
    workers send (every rank of a sharded engine may write the same metadata) must have the same bytes."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.sums: dict[str, str] = {}
        self.bytes = 0
        self._name: str | None = None
        self._digest: Any = None
        self._fh: Any = None
        self._duplicate = False

    def take(self, chunk: Chunk) -> None:
        name = safe_name(chunk.name)
        if name != self._name:
            self._open(name)
        self._digest.update(chunk.data)
        self.bytes += len(chunk.data)
        if self._fh is not None:
            self._fh.write(chunk.data)
        if chunk.last:
            self._close(chunk)

    def _open(self, name: str) -> None:
        if self._name is not None:
            raise TransferError(f"checkpoint file {self._name} ended without its last chunk")
        self._name, self._digest = name, hashlib.sha256()
        self._duplicate = name in self.sums
        if not self._duplicate:
            target = self.directory / name
            target.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(target, "wb")  # noqa: SIM115 - open across chunks, closed by _close or close

    def _close(self, chunk: Chunk) -> None:
        got = self._digest.hexdigest()
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        name, self._name = chunk.name, None
        if got != chunk.sha256:
            raise TransferError(f"checkpoint file {name} arrived with SHA-256 {got}, the worker sent {chunk.sha256}")
        if self._duplicate and self.sums[name] != got:
            raise TransferError(f"two workers wrote checkpoint file {name} with different contents")
        self.sums[name] = got

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def rank_file(name: str) -> tuple[int, int] | None:
    """(rank, world size) of a file one rank of a sharded engine wrote, or None."""
    match = RANK_FILE.search(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def rank_part(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files of a checkpoint one rank loads: all but the other ranks' own files of the same world size."""
    out = []
    for name in names:
        owner = rank_file(name)
        if owner is None or owner[1] != world_size or owner[0] == rank:
            out.append(name)
    return out


@dataclass
class Shipped:
    """One file of a checkpoint in Ray's object store: its chunks' refs, its size and SHA-256."""

    name: str
    refs: list[Any]
    size: int
    sha256: str


def ship(directory: Path, names: list[str]) -> list[Shipped]:
    """The driver's side of loading: ``names`` (files of the verified checkpoint ``directory``) into the object store,
    chunk by chunk."""
    import ray

    out = []
    for name in names:
        digest, refs, size = hashlib.sha256(), [], 0
        with open(directory / name, "rb") as fh:
            for block in iter(lambda: fh.read(CHUNK), b""):
                digest.update(block)
                size += len(block)
                refs.append(ray.put(block))
        out.append(Shipped(name, refs, size, digest.hexdigest()))
    return out


def unpack(files: list[Shipped], directory: Path) -> int:
    """The worker's side of loading: fetch each file's chunks into ``directory``, checking its SHA-256; the bytes."""
    import ray

    total = 0
    for shipped in files:
        target = directory / safe_name(shipped.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        with open(target, "wb") as fh:
            for ref in shipped.refs:
                block = ray.get(ref)
                digest.update(block)
                fh.write(block)
                total += len(block)
        if digest.hexdigest() != shipped.sha256:
            raise TransferError(f"checkpoint file {shipped.name} arrived with SHA-256 {digest.hexdigest()}, the "
                                f"driver sent {shipped.sha256}")
    return total
