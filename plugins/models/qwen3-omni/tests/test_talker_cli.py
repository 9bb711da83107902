"""The talker through the real CLI on `--preset tiny-talker` (builtin:speech, the speech-signal reward): training
with an evaluation and a TensorBoard tracker, `omnirl eval` (per-prompt scores, the WAV files beside) and
`omnirl report` (a player per speech sample)."""

from __future__ import annotations

import json
import os
import wave
from pathlib import Path

import pytest

from omnirl_core.config import DataSection
from omnirl_core.data.sources import load_data
from omnirl_core.testing import run_train
from omnirl_core.testing.forkserver import run_omnirl

SMALL = ["--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=2",
         "--set", "rollout.options.max_new_tokens=8", "--set", "run.sample_every=1"]


def _seconds(path: Path) -> float:
    with wave.open(str(path)) as wav:
        assert wav.getframerate() == 24_000 and wav.getnchannels() == 1
        return wav.getnframes() / wav.getframerate()


@pytest.mark.slow
def test_talker_run_eval_and_report_carry_the_speech(tmp_path: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    records = run_train(run, "--model", "qwen3-omni", "--algo", "gspo", "--preset", "tiny-talker", "--steps", "2",
                        *SMALL, "--set", "run.eval_every=2", "--set", "run.eval_prompts=3",
                        "--set", "run.eval_samples=2", "--tracker", "tensorboard")
    assert [r["step"] for r in records] == [1, 2] and "eval/reward/speech-signal" in records[1]
    listing = [json.loads(line) for line in (run / "samples" / "step-000001.jsonl").read_text().splitlines()]
    speech = load_data(DataSection(prompts="builtin:speech"))
    assert {x["prompt"] for x in listing} <= {r["prompt"] for r in speech.train}  # the preset's builtin:speech
    # the trackers got the step's speech samples as audio
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"audio": 0})
    acc.Reload()
    assert {"samples/0", "samples/3", "eval/samples/0"} <= set(acc.Tags()["audio"])
    assert [e.step for e in acc.Audio("samples/0")] == [1, 2] and acc.Audio("eval/samples/0")[0].step == 2

    env = {**os.environ}
    proc = run_omnirl(["eval", str(run), "--max-prompts", "3", "--samples", "2"], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = run / "eval" / "step-000002"
    result = json.loads((folder / "results.json").read_text())["models"]["trained"]
    assert [p["prompt"] for p in result["per_prompt"]] == [r["prompt"] for r in speech.test[:3]]
    for entry in result["per_prompt"]:
        assert 0.0 <= entry["speech-signal"] <= 1.0 and len(entry["audio"]) == 2
        for name in entry["audio"]:
            assert 0 < _seconds(folder / name) <= 8 * 0.08 + 1e-9  # at most max_new_tokens frames of 80 ms
    for row in result["samples"]:
        assert row["seconds"] == pytest.approx(_seconds(folder / row["audio"]), abs=1e-3)

    proc = run_omnirl(["report", str(run), "--out", str(tmp_path / "report.html")], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (tmp_path / "report.html").read_text()
    # 4 samples of each of the 2 steps (a group of 2 x 2 prompts), the first 6 evaluated ones
    assert page.count('<audio controls preload="metadata" src="data:audio/wav;base64,') == 4 + 4 + 6
