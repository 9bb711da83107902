"""A checkpoint's manifest covers every file: a file the manifest leaves out, a cut manifest, or a component file the
manifest does not list is refused, not loaded unchecked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnirl_core.rundir.checkpoint import CHECKSUMS, CheckpointError, save_checkpoint, verify


def _checkpoint(run_dir: Path) -> Path:
    def write_state(directory: Path) -> list[str]:
        (directory / "weights.safetensors").write_bytes(bytes(range(256)))
        (directory / "shards").mkdir()
        (directory / "shards" / "rank-00000.safetensors").write_bytes(b"shard")
        return ["weights.safetensors", "shards/"]

    return save_checkpoint(run_dir, 2, write_state, {"seed": 0}, b'{"step": 1}\n{"step": 2}\n')


def test_a_complete_checkpoint_verifies(tmp_path: Path):
    state = verify(_checkpoint(tmp_path))
    assert state["step"] == 2 and state["files"] == ["weights.safetensors", "shards/"]


def test_an_emptied_manifest_does_not_let_a_flipped_byte_through(tmp_path: Path):
    path = _checkpoint(tmp_path)
    (path / CHECKSUMS).write_text(json.dumps({"sha256": {}}))
    data = bytearray((path / "weights.safetensors").read_bytes())
    data[10] ^= 0xFF
    (path / "weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as info:
        verify(path)
    details = "\n".join(info.value.details)
    assert "weights.safetensors: not in checksums.json" in details
    assert "trainer_state.json: required, but not in checksums.json" in details


def test_a_file_dropped_from_the_manifest_is_refused(tmp_path: Path):
    path = _checkpoint(tmp_path)
    manifest = json.loads((path / CHECKSUMS).read_text())
    del manifest["sha256"]["shards/rank-00000.safetensors"]
    (path / CHECKSUMS).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as info:
        verify(path)
    assert "rank-00000.safetensors: not in checksums.json" in "\n".join(info.value.details)


def test_a_component_file_missing_from_disk_and_manifest_is_refused(tmp_path: Path):
    path = _checkpoint(tmp_path)
    manifest = json.loads((path / CHECKSUMS).read_text())
    del manifest["sha256"]["weights.safetensors"]
    (path / CHECKSUMS).write_text(json.dumps(manifest))
    (path / "weights.safetensors").unlink()
    with pytest.raises(CheckpointError) as info:
        verify(path)
    assert "weights.safetensors: written by a component, but not in checksums.json" in "\n".join(info.value.details)


def test_a_manifest_of_the_wrong_shape_is_refused(tmp_path: Path):
    path = _checkpoint(tmp_path)
    (path / CHECKSUMS).write_text(json.dumps({"sha256": ["weights.safetensors"]}))
    with pytest.raises(CheckpointError, match="is not a map of file names to checksums"):
        verify(path)
