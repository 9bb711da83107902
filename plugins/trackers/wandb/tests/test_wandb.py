import json
from pathlib import Path

import pytest
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
    assert len(runs) == 2 and all(r.name.endswith(run_id) for r in runs)
    assert all(list(directory.glob(f"run-{run_id}.wandb")) for directory in runs)
    # the first run's file is complete (a resume in a new process, as a real one is: tests/test_trackers.py)
    [file] = runs[0].glob(f"run-{run_id}.wandb")
    assert file.read_bytes()[:4] == b":W&B" and file.stat().st_size > 1000
    assert list((runs[0] / "files" / "media" / "images").glob("samples_*.png"))
