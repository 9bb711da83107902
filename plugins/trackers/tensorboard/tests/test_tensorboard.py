from pathlib import Path

import pytest
from omnirl_plugin_tensorboard.tracker import TensorBoardOptions, TensorBoardTracker
from PIL import Image

from omnirl_core.loop.trackers import StepEvent, TrackerRun

pytest.importorskip("tensorboard")


def _events(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"images": 0, "scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def _log(run_dir: Path, start: int, steps: list[int], offset: float, grid: Path) -> None:
    tracker = TensorBoardTracker()
    tracker.start(TrackerRun(run_dir, "run", {"model": {"name": "x"}}, start_step=start))
    for step in steps:
        tracker.log(StepEvent(step=step, metrics={"reward/mean": step + offset, "kl": float("nan")},
                              images={"samples": grid}, histograms={"reward/total": [0.1, 0.5, step + offset]}))
    tracker.close()


def test_scalars_images_histograms_and_a_resume_that_redoes_steps(tmp_path: Path):
    grid = tmp_path / "grid.png"
    Image.new("RGB", (40, 20), (255, 0, 0)).save(grid)
    _log(tmp_path, 1, [1, 2, 3], 0.0, grid)
    _log(tmp_path, 3, [3, 4], 0.5, grid)  # resumed from step 2's checkpoint: step 3 again
    acc = _events(tmp_path / "tensorboard")
    assert [(s.step, s.value) for s in acc.Scalars("reward/mean")] == [(1, 1.0), (2, 2.0), (3, 3.5), (4, 4.5)]
    images = acc.Images("samples")
    assert [i.step for i in images] == [1, 2, 3, 4] and (images[0].width, images[0].height) == (40, 20)
    assert [h.step for h in acc.Histograms("reward/total")] == [1, 2, 3, 4]


def test_options_turn_images_and_histograms_off(tmp_path: Path):
    grid = tmp_path / "grid.png"
    Image.new("RGB", (8, 8)).save(grid)
    tracker = TensorBoardTracker(TensorBoardOptions(images=False, histograms=False, log_dir=str(tmp_path / "tb")))
    tracker.start(TrackerRun(tmp_path, "run", {}, start_step=1))
    tracker.log(StepEvent(step=1, metrics={"a": 1.0}, images={"samples": grid}, histograms={"h": [1.0]}))
    tracker.close()
    tags = _events(tmp_path / "tb").Tags()
    assert tags["scalars"] == ["a"] and tags["images"] == [] and tags["histograms"] == []
