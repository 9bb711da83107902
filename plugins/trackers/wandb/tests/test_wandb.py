import json
import re
import time
from pathlib import Path

import pytest
from omnirl_plugin_wandb.records import read_run_records
from omnirl_plugin_wandb.tracker import RUN_ID_FILE, WandbOptions, WandbTracker
from PIL import Image

from omnirl_core.loop.trackers import StepEvent, TrackerRun

pytest.importorskip("wandb")


def test_an_offline_run_writes_its_files_and_a_resume_keeps_the_run_id(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    grid = tmp_path / "grid.png"
    Image.new("RGB", (16, 8), (0, 255, 0)).save(grid)
    for start in (1, 3):
        tracker = WandbTracker(WandbOptions(mode="offline", project="omnirl-test"))
        tracker.start(TrackerRun(tmp_path, "run", {"run": {"seed": 0}}, start_step=start))
        for step in (start, start + 1):
            tracker.log(StepEvent(step=step, metrics={"reward/mean": 0.5}, images={"samples": grid},
                                  histograms={"reward/total": [0.1, 0.9]}))
        tracker.close()
    run_id = json.loads((tmp_path / RUN_ID_FILE).read_text())["id"]
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # wandb names a run's directory offline-run-<time>-<id>, with "-1" added when the resume starts in the same second
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", r.name) for r in runs)
    assert all(list(directory.glob(f"run-{run_id}.wandb")) for directory in runs)
    # the first run's file is complete (a resume in a new process, as a real one is: tests/test_trackers.py)
    [file] = runs[0].glob(f"run-{run_id}.wandb")
    assert file.read_bytes()[:4] == b":W&B" and file.stat().st_size > 1000
    assert list((runs[0] / "files" / "media" / "images").glob("samples_*.png"))


def finished_records(file: Path, timeout_s: float = 60.0) -> list:
    """The run file's records once wandb's service has written them all (its last record is the run's exit): an
    offline run's ``finish()`` can return before the service has written the file (1 in 12 here: the 7-byte header
    alone, the whole file 2 s later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_run_records(file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def test_speech_samples_are_logged_as_audio_files_with_their_captions(tmp_path: Path, monkeypatch):
    import torch

    from omnirl_core.contracts.data import Speech
    from omnirl_core.loop.trackers import AudioClip
    from omnirl_core.rundir.audio import write_wav

    monkeypatch.setenv("WANDB_SILENT", "true")
    folder = tmp_path / "samples" / "step-000001"
    folder.mkdir(parents=True)
    clips = []
    for n in range(3):
        t = torch.arange(2400 + 800 * n) / 24000
        speech = Speech(0.5 * torch.sin(2 * torch.pi * (220 + 110 * n) * t), 24000, f"Gate {n}, Ms. Lee.")
        clips.append(AudioClip(write_wav(folder / f"{n:03d}.wav", speech), f"Gate {n}, Ms. Lee. (reward 0.{n}00)"))
    tracker = WandbTracker(WandbOptions(mode="offline", project="omnirl-test", audio_clips=2))
    tracker.start(TrackerRun(tmp_path, "run", {}, start_step=1))
    tracker.log(StepEvent(step=1, metrics={"reward/mean": 0.5}, audio={"samples": clips}))
    tracker.close()
    [run] = (tmp_path / "wandb").glob("offline-run-*")
    logged = sorted((run / "files" / "media" / "audio").rglob("*.wav"))
    assert len(logged) == 2  # audio_clips=2 of the 3
    # wandb keeps the files as they are: each logged file is one of the first two clips, byte for byte
    assert sorted(f.read_bytes() for f in logged) == sorted(c.path.read_bytes() for c in clips[:2])
    [file] = run.glob("run-*.wandb")
    [history] = [r.history for r in finished_records(file) if r.WhichOneof("record_type") == "history"]
    row: dict = {}  # a logged object's fields come as items of their own: nested_key = (key, field)
    for item in history.item:
        path = [item.key] if item.key else list(item.nested_key)
        if len(path) == 1:
            row[path[0]] = json.loads(item.value_json)
        else:
            row.setdefault(path[0], {})[path[1]] = json.loads(item.value_json)
    assert row["_step"] == 1 and "samples/2" not in row
    for n in range(2):
        entry = row[f"samples/{n}"]
        assert entry["_type"] == "audio-file" and entry["caption"] == f"Gate {n}, Ms. Lee. (reward 0.{n}00)"
        assert (run / "files" / entry["path"]).read_bytes() == clips[n].path.read_bytes()

