"""Reading back what the tracker wrote: the records of a W&B run file (``run-*.wandb``, what an offline run keeps
and ``wandb sync`` uploads), for checking a run's logged history without a W&B server."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7  # CRC-32, length, kind: 1 whole, 2 first, 3 middle, 4 last


class DamagedRunFile(ValueError):
    """The file is not a W&B run file, or a chunk's checksum does not match (a torn or damaged file)."""


def read_run_records(path: Path) -> list[Any]:
    """The protobuf records (``wandb_internal_pb2.Record``) of a W&B run file: 32 KiB blocks of chunks, each
    checksummed; every checksum is verified."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    if (ident, magic, version) != (b":W&B", 0xBEE1, 0):
        raise DamagedRunFile(f"{path} is not a W&B run file (header {data[:HEADER]!r})")
    pos, pending, records = HEADER, b"", []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise DamagedRunFile(f"{path}: bad checksum at byte {pos}")
        pos += HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records
