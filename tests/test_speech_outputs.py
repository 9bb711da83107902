"""Speech through the core: the shipped texts to speak (builtin:speech), an evaluation's per-prompt scores with
the WAV files beside them, the report's audio players (which play: their duration, read in headless Chromium) and
the clips the trackers get. Speech is made here (tones), no model: the talker's own tests are the plugin's."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import wave
from pathlib import Path

import pytest
import torch

from omnirl_core.config import DataSection
from omnirl_core.contracts.data import Speech
from omnirl_core.data.sources import load_data
from omnirl_core.loop.evaluation import EvalResult, write_results
from omnirl_core.loop.trackers import saved_audio, step_audio
from omnirl_core.rundir.report import build_report
from omnirl_core.rundir.rundir import RunDir

RATE = 24_000


def _speech(text: str, n: int) -> Speech:
    """A tone of its own pitch and length (0.2 s + 0.05 s per n)."""
    t = torch.arange(4800 + 1200 * n) / RATE
    return Speech(0.4 * torch.sin(2 * torch.pi * (200 + 40 * n) * t), RATE, text)


def _frames(path: Path) -> tuple[int, int]:
    with wave.open(str(path)) as wav:
        return wav.getnframes(), wav.getframerate()


def test_builtin_speech_holds_short_texts_with_numbers_names_and_punctuation():
    data = load_data(DataSection(prompts="builtin:speech"))
    assert data.split == "split column" and len(data.train) >= 200 and len(data.test) >= 40
    records = data.train + data.test
    assert len({r["prompt"] for r in records}) == len(records)
    for r in records:
        said = sum(ch.isalnum() for ch in r["prompt"])
        assert 10 <= said <= 32, r  # 0.8 - 2.7 s at 12 letters and digits a second: within the tiny talker's 2.9 s
        assert r["prompt"][-1] in ".?!" and r["prompt"][0].isupper(), r
    kinds = {r["kind"] for r in records}
    assert len(kinds) >= 10
    assert len({r["kind"] for r in data.test[:12]}) >= 6  # the first held-out prompts mix the kinds
    share = {name: sum(bool(re.search(pattern, r["prompt"])) for r in records) / len(records)
             for name, pattern in [("number", r"\d"), ("comma", ","), ("question", r"\?"), ("exclamation", "!"),
                                   ("time", r"\d:\d\d"), ("ordinal", r"\d(st|nd|rd|th)\b"), ("percent", "%"),
                                   ("abbreviation", r"\b(Mr|Ms|Dr)\.")]}
    assert share["number"] > 0.6 and share["comma"] > 0.2 and share["question"] > 0.1, share
    assert min(share.values()) > 0.03, share


def _eval_result(label: str) -> EvalResult:
    prompts = ["Hello, my name is Anna.", "Room 12 is on the 3rd floor."]
    result = EvalResult(label, ["reward", "speech-signal", "asr-error"])
    for i, prompt in enumerate(prompts):
        for k in range(2):
            n = 2 * i + k
            result.rows.append({"prompt": prompt, "sample": k, "seed": 100 + n, "speech-signal": 0.5 + 0.1 * n,
                                "asr-error": 0.2 * n, "reward": 0.5 + 0.3 * n})
            result.outputs.append(_speech(prompt, n))
    return result


def test_eval_of_speech_gives_per_prompt_scores_with_the_wav_files_beside(tmp_path: Path):
    result = _eval_result("trained")
    path = write_results(tmp_path / "eval" / "step-000002", [result], {"step": 2}, samples_per_prompt=2)
    data = json.loads(path.read_text())["models"]["trained"]
    assert data["grid"] == "trained.jsonl"
    first, second = data["per_prompt"]
    assert first["prompt"] == "Hello, my name is Anna." and first["samples"] == 2
    assert first["speech-signal"] == pytest.approx(0.55) and first["asr-error"] == pytest.approx(0.1)
    assert second["asr-error"] == pytest.approx(0.5) and second["reward"] == pytest.approx(1.25)
    assert first["audio"] == ["trained/0000.wav", "trained/0001.wav"]
    assert second["audio"] == ["trained/0002.wav", "trained/0003.wav"]
    folder = path.parent
    for n, row in enumerate(data["samples"]):
        assert row["audio"] == f"trained/{n:04d}.wav"
        assert _frames(folder / row["audio"]) == (4800 + 1200 * n, RATE)
        assert row["seconds"] == pytest.approx((4800 + 1200 * n) / RATE, abs=1e-3)
    listing = [json.loads(line) for line in (folder / "trained.jsonl").read_text().splitlines()]
    assert [x["audio"] for x in listing] == [r["audio"] for r in data["samples"]]
    assert listing[3]["text"] == "Room 12 is on the 3rd floor." and listing[3]["asr-error"] == pytest.approx(0.6)
    clips = saved_audio(folder / "trained.jsonl", folder)  # what a tracker gets of an evaluation
    assert [c.path for c in clips] == [folder / r["audio"] for r in data["samples"]]
    assert clips[1].caption == "Hello, my name is Anna. (reward 0.800)"


def _speech_run(root: Path) -> tuple[Path, list[tuple[Path, int]]]:
    """A run directory as a talker run leaves it: 3 steps, speech samples saved at steps 1 and 3, an evaluation at
    step 3. Returns it and every WAV the report should play, with its frame count, in page order."""
    run = root / "run"
    rd = RunDir(run)
    rd.prepare({"model": {"name": "qwen3-omni", "preset": "tiny-talker"}, "algorithm": {"name": "gspo"},
                "rewards": [{"name": "speech-signal", "weight": 1.0}], "run": {"steps": 3},
                "data": {"prompts": "builtin:speech"}, "rollout": {"prompts_per_step": 2, "group_size": 3}}, [])
    played = []
    for step in (1, 3):
        speeches = [_speech(f"Gate {n}, Ms. Lee.", n) for n in range(6)]
        rd.save_grid(step, speeches, [s.text for s in speeches], columns=3, rewards=[0.1 * n for n in range(6)])
        played += [(run / "samples" / f"step-{step:06d}" / f"{n:03d}.wav", 4800 + 1200 * n) for n in range(4)]
    for step in (1, 2, 3):
        rd.append_metrics({"step": step, "reward/mean": 0.5 + 0.01 * step, "reward/std": 0.1, "time/step_s": 1.0})
    write_results(run / "eval" / "step-000003", [_eval_result("trained")], {"step": 3, "prompts": "builtin:speech"},
                  samples_per_prompt=2)
    played += [(run / "eval" / "step-000003" / "trained" / f"{n:04d}.wav", 4800 + 1200 * n) for n in range(4)]
    return run, played


def test_report_plays_each_speech_sample_beside_its_text(tmp_path: Path):
    run, played = _speech_run(tmp_path)
    page = build_report(run)
    players = re.findall(r'<audio controls preload="metadata" src="data:audio/wav;base64,([A-Za-z0-9+/=]+)">', page)
    assert len(players) == len(played) == 12  # 4 of each saved step's samples, the 4 evaluated samples
    assert [base64.b64decode(p) for p in players] == [path.read_bytes() for path, _ in played]
    assert page.count("Gate 0, Ms. Lee.") == 2 and "Room 12 is on the 3rd floor." in page
    assert "<th>speech-signal</th><th>asr-error</th><th>audio</th>" in page  # the eval table: scores, then player
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing to fetch
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium): the players were not loaded")
    # the page as written, plus a script that writes each player's duration into the DOM once every player has
    # read its metadata (or failed: NaN); --dump-dom prints the DOM after the page's (virtual) time has run out
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", """<script>
const players = [...document.querySelectorAll('audio')];
function mark() {
  if (players.every(a => a.readyState >= 1 || a.error)) {
    document.body.dataset.durations = players.map(a => a.error ? 'error' : String(a.duration)).join(',');
  }
}
players.forEach(a => { a.addEventListener('loadedmetadata', mark); a.addEventListener('error', mark); });
mark();
</script></body>"""))
    proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", "--no-first-run", "--mute-audio",
                           "--virtual-time-budget=20000", "--dump-dom", probe.resolve().as_uri()],
                          capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path)
    found = re.search(r'data-durations="([^"]*)"', proc.stdout)
    assert found, f"the players did not all load: {proc.stdout[-500:]!r} {proc.stderr[-1500:]!r}"
    durations = found.group(1).split(",")
    assert len(durations) == len(played)
    for value, (path, frames) in zip(durations, played):
        seconds = float(value)  # 'error' or 'NaN' fails here or below
        assert seconds > 0 and seconds == pytest.approx(frames / RATE, abs=2e-3), (path, value)


def test_trackers_get_the_speech_samples_a_step_saved(tmp_path: Path):
    run, _ = _speech_run(tmp_path)
    audio = step_audio(run, 3, samples=True, evaluation=True)
    assert sorted(audio) == ["eval/samples", "samples"]
    assert [c.path.name for c in audio["samples"]] == [f"{n:03d}.wav" for n in range(6)]
    assert audio["samples"][2].caption == "Gate 2, Ms. Lee. (reward 0.200)"
    assert all(c.path.is_file() for clips in audio.values() for c in clips)
    assert step_audio(run, 2, samples=True, evaluation=True) == {}  # step 2 saved nothing
    assert step_audio(run, 3, samples=False, evaluation=False) == {}
    text = RunDir(tmp_path / "text")
    text.samples.mkdir(parents=True)
    text.save_grid(1, ["an answer"], ["a question"], columns=1, rewards=[1.0])  # text outputs: no audio
    assert step_audio(text.path, 1, samples=True, evaluation=False) == {}
    torn = run / "samples" / "step-000001.jsonl"
    torn.write_text(torn.read_text()[:-40])  # a damaged listing: the run goes on, the trackers get no audio of it
    assert step_audio(run, 1, samples=True, evaluation=False) == {}
