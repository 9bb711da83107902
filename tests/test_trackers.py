"""Trackers: a run logs to TensorBoard (read back with TensorBoard's own reader) and to W&B in offline mode
(the run file read back record by record, checksums included); a resumed run shows each step once; a failing
tracker is a warning, never a failed run."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from omnirl_plugin_wandb.records import read_run_records

from omnirl_core.contracts import Tracker
from omnirl_core.loop.trackers import StepEvent, TrackerRun, TrackerSet, resolve_trackers

from .conftest import run_cli

FIXTURES = str(Path(__file__).parent / "fixture_plugins")
BASE = ["train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny",
        "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4", "--set", "run.save_every=2",
        "--set", "run.sample_every=2", "--tracker", "tensorboard", "--tracker", "wandb", "--tracker", "broken-log",
        "--tracker", "broken-start", "--set", "data.prompts=builtin:colors", "--set", "run.eval_every=2",
        "--set", "run.eval_prompts=2", "--set", "run.eval_samples=1",
        "--set", "run.threads=fixed"]  # compared across processes: the same thread count whatever the load
SAME = ("reward/mean", "reward/std", "loss", "kl", "clip_frac")
ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": FIXTURES, "OMNIRL_PLUGINS": "faulty_trackers"}


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _history(records: list) -> list[dict]:
    out = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            out.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return out


@pytest.mark.slow
def test_a_run_logs_to_tensorboard_and_wandb_and_a_resume_shows_each_step_once(tmp_path: Path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    first = run_cli(*BASE, "--steps", "3", "--output-dir", str(run), env=ENV)
    assert first.returncode == 0, first.stderr[-3000:]
    # the failing trackers: warned about, and the run finished
    assert "tracker 'broken-log' failed to log step 1: OSError: disk full at step 1; the run goes on" in first.stderr
    assert "tracker 'broken-start' needs nothing-here: pip install nothing-here" in first.stderr
    assert first.stderr.count("tracker 'broken-log' failed") == 3  # then silenced
    before = _metrics(run)
    # an attempt that died after logging step 3 but before saving it: its checkpoint is gone
    shutil.rmtree(run / "checkpoints" / "step-000003")
    second = run_cli(*BASE, "--steps", "4", "--output-dir", str(run), env=ENV)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming" in second.stderr
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # step 3 again, without the evaluation of step 2 before it in this process: the same numbers (the
    # evaluation leaves the training untouched), and the evaluations land in their steps' rows
    assert {k: rows[2][k] for k in SAME} == pytest.approx({k: before[2][k] for k in SAME}, abs=1e-6)
    assert [r["step"] for r in rows if "eval/reward/mean" in r] == [2, 4]

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    assert {"reward/mean", "reward/color", "kl", "clip_frac", "time/step_s"} <= set(tags["scalars"])
    scalars = events.Scalars("reward/mean")
    assert [s.step for s in scalars] == [1, 2, 3, 4]  # step 3 once: the redone one
    assert [s.value for s in scalars] == pytest.approx([r["reward/mean"] for r in rows], rel=1e-6)
    assert [i.step for i in events.Images("samples")] == [1, 2, 4]  # sample_every=2, step 1 and the last
    image = events.Images("samples")[0]
    assert image.width >= 4 * 32 and image.encoded_image_string.startswith(b"\x89PNG")
    assert {"reward/total", "reward/color"} <= set(tags["histograms"])
    assert [s.step for s in events.Scalars("eval/reward/mean")] == [2, 4]  # the first attempt's step 3: purged
    assert [i.step for i in events.Images("eval/samples")] == [2, 4]

    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # one per invocation, the same W&B run id (resumed)
    run_id = json.loads((run / "wandb-run.json").read_text())["id"]
    assert all(r.name.endswith(run_id) for r in runs)
    steps = []
    for directory in runs:
        [file] = directory.glob("run-*.wandb")
        history = _history(read_run_records(file))
        steps.append([h["_step"] for h in history])
        assert all("reward/mean" in h and "kl" in h for h in history)
    assert steps == [[1, 2, 3], [3, 4]]
    first_history = _history(read_run_records(next(runs[0].glob("run-*.wandb"))))
    assert [h["_step"] for h in first_history if h.get("samples/_type") == "image-file"] == [1, 2, 3]
    assert "hist/reward/total/_type" in first_history[0]
    assert len(list((runs[0] / "files" / "media" / "images").glob("samples_*.png"))) == 3


class _Recorder(Tracker):
    def __init__(self, options=None):
        self.events: list[int] = []

    def start(self, run):
        self.run = run

    def log(self, event):
        self.events.append(event.step)

    def close(self):
        pass


def test_tracker_set_goes_on_past_a_failing_tracker(manager, caplog):
    from omnirl_core import hookimpl
    from omnirl_core.config import RunConfig
    from omnirl_core.errors import ConfigError, PluginError
    from omnirl_core.registry import TrackerSpec

    recorder = _Recorder()

    class Plugin:
        @hookimpl
        def omnirl_register_trackers(self, register):
            register(TrackerSpec(name="ok", factory=lambda options: recorder))
            register(TrackerSpec(name="bad", factory="no_such_module:Tracker", requires=("no-such",)))

    manager.register(Plugin(), "test-trackers")
    cfg = RunConfig.model_validate({"run": {"trackers": [{"name": "bad"}, {"name": "ok"}]}})
    trackers = TrackerSet(resolve_trackers(manager, cfg))
    with caplog.at_level(logging.WARNING, logger="omnirl.trackers"):
        trackers.start(TrackerRun(Path("."), "x", {}, start_step=5))
        trackers.log(StepEvent(step=5, metrics={"reward/mean": 1.0}))
        trackers.close()
    assert recorder.events == [5] and recorder.run.resumed
    assert "tracker 'bad' failed to start: ModuleNotFoundError" in caplog.text
    with pytest.raises(PluginError, match="Unknown tracker 'tensorbord'"):
        resolve_trackers(manager, RunConfig.model_validate({"run": {"trackers": [{"name": "tensorbord"}]}}))
    with pytest.raises(ConfigError) as err:
        resolve_trackers(manager, RunConfig.model_validate({"run": {"trackers": [{"name": "ok",
                                                                                   "options": {"x": 1}}]}}))
    assert "run.trackers.0.options: this plugin takes no options, got ['x']" in err.value.render()
