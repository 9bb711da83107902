"""The README's main job, end to end through the real CLI: it learns, and its run directory holds
everything a user needs. Then resume."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml
from PIL import Image
from safetensors.torch import load_file

from .conftest import run_cli

MAIN_JOB = ["train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny"]
REQUIRED_KEYS = {
    "step", "reward/mean", "reward/std", "reward/color", "loss", "kl", "clip_frac", "time/rollout_s",
    "time/reward_s", "time/train_s", "time/step_s", "images_per_s", "logprob/abs_delta_max",
}


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_main_job_learns_and_writes_a_complete_run_directory(tmp_path: Path):
    run = tmp_path / "run"
    proc = run_cli(*MAIN_JOB, "--output-dir", str(run), timeout=2400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _metrics(run)
    assert [r["step"] for r in records] == list(range(1, 201))
    assert REQUIRED_KEYS <= set(records[0])
    # learning: the last 10 steps beat the first 10 by at least 2 standard errors
    first = [r["reward/mean"] for r in records[:10]]
    last = [r["reward/mean"] for r in records[-10:]]
    se = (statistics.variance(first) / 10 + statistics.variance(last) / 10) ** 0.5
    assert statistics.fmean(last) - statistics.fmean(first) > 2 * se, (first, last)
    # step 1 re-evaluates every stored transition with unchanged weights: identical log-probs
    assert records[0]["logprob/abs_delta_max"] <= 1e-5
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["name"] == "qwen-image" and config["model"]["preset"] == "tiny"
    assert config["algorithm"]["options"]["clip_range"] == 1e-3  # plugin options resolved with defaults
    lock = json.loads((run / "plugins.lock.json").read_text())
    used = {p["name"] for p in lock if p["used"]}
    assert {"qwen-image", "flowgrpo", "diffusers", "torch", "color", "cpu"} <= used
    assert all(p["version"] for p in lock)
    grids = sorted((run / "samples").glob("step-*.png"))
    assert grids and Image.open(grids[-1]).size[0] >= 8 * 32
    assert Image.open(run / "reward_curve.png").size == (640, 360)
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert ckpt.name == "step-000200"
    lora = load_file(str(ckpt / "pytorch_lora_weights.safetensors"))
    assert lora and all(k.startswith("transformer.") for k in lora)
    assert (ckpt / "optimizer.safetensors").is_file()
    assert "done: 200 steps" in proc.stderr


def test_resume_continues_where_the_run_stopped(tmp_path: Path):
    run = tmp_path / "run"
    fixed = ["--set", "run.threads=fixed"]  # compared with a straight run: the same thread count whatever the load
    args = [*MAIN_JOB, *fixed, "--output-dir", str(run), "--set", "run.save_every=1"]
    first = run_cli(*args, "--steps", "2")
    assert first.returncode == 0, first.stderr[-2000:]
    before = _metrics(run)
    second = run_cli(*args, "--steps", "4")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming" in second.stderr
    records = _metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[:2] == before  # the first two steps were not redone
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000004"
    # a resumed run draws the same prompts/seeds as an uninterrupted one: compare with a straight run
    straight = tmp_path / "straight"
    third = run_cli(*MAIN_JOB, *fixed, "--output-dir", str(straight), "--steps", "4", "--set", "run.save_every=1")
    assert third.returncode == 0
    for a, b in zip(records, _metrics(straight)):
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-6)
