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


def _speech_files(folder: Path, count: int) -> list:
    """``count`` WAV files of tones of different pitch and length, as the run directory keeps speech."""
    import torch

    from omnirl_core.contracts.data import Speech
    from omnirl_core.loop.trackers import AudioClip
    from omnirl_core.rundir.audio import write_wav

    folder.mkdir(parents=True, exist_ok=True)
    clips = []
    for n in range(count):
        t = torch.arange(2400 + 800 * n) / 24000
        speech = Speech(0.5 * torch.sin(2 * torch.pi * (220 + 110 * n) * t), 24000, f"Room {n} is on the 2nd floor.")
        clips.append(AudioClip(write_wav(folder / f"{n:03d}.wav", speech), f"{speech.text} (reward 0.{n}00)"))
    return clips


def test_speech_samples_are_logged_as_audio_with_their_texts(tmp_path: Path):
    import io
    import wave

    import numpy as np
    from omnirl_plugin_tensorboard.tracker import _read_wav

    clips = _speech_files(tmp_path / "samples" / "step-000001", 3)
    tracker = TensorBoardTracker(TensorBoardOptions(audio_clips=2))
    tracker.start(TrackerRun(tmp_path, "run", {}, start_step=1))
    tracker.log(StepEvent(step=1, metrics={"reward/mean": 0.5}, audio={"samples": clips}))
    tracker.log(StepEvent(step=2, metrics={"reward/mean": 0.6}))  # a step that saved no samples logs none
    tracker.close()
    acc = _events(tmp_path / "tensorboard")
    assert sorted(acc.Tags()["audio"]) == ["samples/0", "samples/1"]  # audio_clips=2 of the 3
    for n in range(2):
        [event] = acc.Audio(f"samples/{n}")
        assert event.step == 1 and event.sample_rate == 24000 and event.content_type == "audio/wav"
        with wave.open(io.BytesIO(event.encoded_audio_string)) as logged:
            assert logged.getframerate() == 24000 and logged.getnframes() == 2400 + 800 * n
            pcm = np.frombuffer(logged.readframes(logged.getnframes()), dtype="<i2") / 32768.0
        source, _ = _read_wav(clips[n].path)
        assert np.abs(pcm - source).max() <= 2 / 32768  # the same sound, to the last bit of 16-bit PCM or so
    [text] = acc.Tensors("samples/texts/text_summary")
    assert text.tensor_proto.string_val[0].decode() == ("0: Room 0 is on the 2nd floor. (reward 0.000)\n\n"
                                                        "1: Room 1 is on the 2nd floor. (reward 0.100)")
    off = TensorBoardTracker(TensorBoardOptions(audio=False, log_dir=str(tmp_path / "off")))
    off.start(TrackerRun(tmp_path, "run", {}, start_step=1))
    off.log(StepEvent(step=1, metrics={"a": 1.0}, audio={"samples": clips}))
    off.close()
    assert _events(tmp_path / "off").Tags()["audio"] == []
