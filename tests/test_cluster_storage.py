"""``run.storage`` without a cluster (issue 32): the storage location (a local path; an fsspec URI, ``file://``, with
fsspec's own filesystem), the record a run directory's checkpoint keeps of its stored part, and the errors a missing
or damaged stored file, a scheme without its package or an executor that cannot read the storage give. The workers'
side runs on a real 3-node cluster in ``test_cluster.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnirl_core.config import build_config
from omnirl_core.errors import ConfigError
from omnirl_core.loop.transfer import TransferError, owners
from omnirl_core.rundir.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    stored_name,
    verify,
)
from omnirl_core.rundir.storage import (
    STORAGE_FILE,
    STORED_MANIFEST,
    Storage,
    StorageError,
    fetch,
    record,
    stored_manifest,
)

SHARD = "shards/rank-00001-of-00002.safetensors"


def _stored_checkpoint(run: Path, location: str, step: int = 1) -> tuple[Path, dict]:
    """A checkpoint whose workers' files went to ``location``, written as the Ray executor writes one: the files
    copied to the storage below ``checkpoints/step-N-<id>``, ``storage.json`` in the run directory's checkpoint."""
    scratch = run.parent / f"scratch-{step}"
    (scratch / "shards").mkdir(parents=True)
    (scratch / "pytorch_lora_weights.safetensors").write_bytes(b"weights" * 100)
    (scratch / SHARD).write_bytes(bytes(range(256)) * 10)
    seen: dict = {}

    def write_state(directory: Path) -> list[str]:
        storage = Storage(location)
        target = f"checkpoints/{stored_name(directory)}"
        files = {name: storage.put(scratch / name, target, name)
                 for name in ("pytorch_lora_weights.safetensors", SHARD)}
        storage.write_bytes(stored_manifest(files), target, STORED_MANIFEST)
        (directory / STORAGE_FILE).write_text(json.dumps(record(location, target, files)))
        seen["target"] = target
        return ["pytorch_lora_weights.safetensors", "shards/"]

    path = save_checkpoint(run, step, write_state, {}, b'{"step": 1}\n')
    return path, json.loads((path / STORAGE_FILE).read_text()) | seen


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_a_stored_checkpoint_keeps_only_its_record_in_the_run_directory_and_verifies(tmp_path: Path, scheme: str):
    location = scheme + str(tmp_path / "store")
    path, entry = _stored_checkpoint(tmp_path / "run", location)
    assert path.name == "step-000001"
    assert sorted(p.name for p in path.iterdir()) == ["checksums.json", "metrics.jsonl", STORAGE_FILE,
                                                       "trainer_state.json"]
    stored = tmp_path / "store" / entry["target"]
    assert entry["target"].startswith("checkpoints/step-000001-") and entry["location"] == location
    assert (stored / SHARD).read_bytes() == bytes(range(256)) * 10
    assert json.loads((stored / STORED_MANIFEST).read_text())["sha256"] == {
        name: meta["sha256"] for name, meta in entry["files"].items()}
    assert verify(path)["step"] == 1
    got = tmp_path / "fetched"
    assert fetch(entry, [SHARD], got) == 2560
    assert (got / SHARD).read_bytes() == (stored / SHARD).read_bytes()


def test_a_missing_or_resized_stored_file_is_refused_naming_it(tmp_path: Path):
    location = str(tmp_path / "store")
    path, entry = _stored_checkpoint(tmp_path / "run", location)
    stored = tmp_path / "store" / entry["target"]
    (stored / SHARD).unlink()
    (stored / "pytorch_lora_weights.safetensors").write_bytes(b"short")
    with pytest.raises(CheckpointError) as caught:
        verify(path)
    err = caught.value
    assert err.exit_code == 2 and "2 problem(s)" in err.message
    text = err.render()
    assert f"{location}/{entry['target']}/{SHARD}: missing (run.storage)" in text
    assert f"{location}/{entry['target']}/pytorch_lora_weights.safetensors: 5 bytes, the checkpoint recorded 700" in text


def test_a_damaged_stored_file_of_the_same_size_is_refused_when_a_worker_fetches_it(tmp_path: Path):
    location = "file://" + str(tmp_path / "store")
    path, entry = _stored_checkpoint(tmp_path / "run", location)
    shard = tmp_path / "store" / entry["target"] / SHARD
    shard.write_bytes(b"\xff" + shard.read_bytes()[1:])
    assert verify(path)["step"] == 1  # sizes agree: the SHA-256 is the reader's to check
    with pytest.raises(StorageError) as caught:
        fetch(entry, [SHARD], tmp_path / "fetched", manifest=str(path / STORAGE_FILE))
    err = caught.value
    assert err.exit_code == 2
    assert err.message.startswith(f"Stored checkpoint file {location}/{entry['target']}/{SHARD} is damaged: its "
                                  "SHA-256 is ")
    assert f"the checkpoint's {path / STORAGE_FILE} says {entry['files'][SHARD]['sha256']}" in err.message
    with pytest.raises(StorageError, match="refusing stored checkpoint file name"):
        fetch({**entry, "files": {"../x": {"sha256": "0", "size": 1}}}, ["../x"], tmp_path / "fetched")


def test_an_executor_that_reads_only_the_run_directory_is_told_where_the_files_are(tmp_path: Path):
    path, _ = _stored_checkpoint(tmp_path / "run", str(tmp_path / "store"))

    def read_here(directory: Path) -> None:
        (directory / "pytorch_lora_weights.safetensors").read_bytes()

    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, read_here)
    assert f"its workers' files are stored in {tmp_path / 'store'} (run.storage)" in caught.value.message
    assert "--executor ray" in caught.value.hint


def test_storage_locations_that_cannot_work_are_refused_with_what_is_missing():
    with pytest.raises(StorageError, match="relative path"):
        Storage("ckpt/here")
    with pytest.raises(StorageError) as caught:
        Storage("s3://bucket/runs/x")  # fsspec knows the scheme; its package (s3fs) is not installed here
    assert caught.value.exit_code == 2
    assert "fsspec cannot open the 's3' scheme here: Install s3fs" in caught.value.message
    with pytest.raises(StorageError, match="Protocol not known: nosuch"):
        Storage("nosuch://x")


def test_run_storage_is_a_ray_setting():
    base = {"model": {"name": "m"}, "algorithm": {"name": "a"}}
    assert build_config({**base, "run": {"executor": "ray", "storage": "s3://b/x"}}).run.storage == "s3://b/x"
    assert build_config(base).run.storage is None
    with pytest.raises(ConfigError) as caught:
        build_config({**base, "run": {"storage": "/mnt/shared/x"}})
    assert "run.storage" in caught.value.render() and "needs run.executor=ray" in caught.value.render()


def test_each_stored_file_goes_from_one_rank_and_ranks_must_agree_on_a_shared_one():
    parts = [{"index.json": ("a", 1), "rank-0.st": ("b", 2)}, {"index.json": ("a", 1), "rank-1.st": ("c", 2)}]
    assert owners(parts) == [["index.json", "rank-0.st"], ["rank-1.st"]]
    with pytest.raises(TransferError, match="ranks 0 and 1 wrote checkpoint file index.json with different"):
        owners([{"index.json": ("a", 1)}, {"index.json": ("z", 1)}])
