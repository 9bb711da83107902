"""Evaluate, sample, report: `omnirl eval` (fixed seeds, the ODE sampler, every reward, paired comparison with
the base model), evaluation during training (the same numbers), `omnirl sample` and `omnirl report` (opened in
headless Chromium when it is installed)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from PIL import Image

from omnirl_core.loop.evaluation import EvalResult, compare, eval_seed, ode_plan
from omnirl_core.testing import screenshot

from .conftest import run_cli

TRAIN = ["train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny",
         "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4", "--set", "run.save_every=2",
         "--set", "data.prompts=builtin:colors", "--set", "run.eval_every=2", "--set", "run.eval_prompts=4",
         "--set", "run.eval_samples=2"]


def test_paired_comparison_and_fixed_seeds():
    assert ode_plan(3).step_kinds == ("ode", "ode", "ode") and ode_plan(3).train_steps == ()
    assert eval_seed(0, "a red car", 1) == eval_seed(0, "a red car", 1) != eval_seed(0, "a red car", 2)
    base = EvalResult("base", ["reward"], rows=[{"prompt": p, "seed": k, "reward": v}
                                                for p, k, v in [("a", 1, 0.1), ("a", 2, 0.3), ("b", 1, 0.5),
                                                                ("b", 2, 0.7)]])
    other = EvalResult("trained", ["reward"], rows=[{**r, "reward": r["reward"] + d}
                                                    for r, d in zip(base.rows, [0.1, 0.3, 0.1, 0.3])])
    c = compare(base, other)["reward"]
    assert c["diff"] == pytest.approx(0.2) and c["pairs"] == 4
    assert c["se"] == pytest.approx(math.sqrt(4 * 0.01 / 3) / 2)  # sd of the differences / sqrt(n)
    assert c["se_prompt"] == pytest.approx(0.0)  # both prompts gain 0.2 on average
    assert base.summary()["reward"]["mean"] == pytest.approx(0.4)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 2-step run on builtin:colors that evaluates during training (step 2)."""
    out = tmp_path_factory.mktemp("eval") / "run"
    proc = run_cli(*TRAIN, "--steps", "2", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_eval_compares_with_base_and_matches_the_evaluation_during_training(run: Path):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "eval/reward/mean" not in rows[0] and rows[1]["eval/reward/color"] == rows[1]["eval/reward/mean"]
    assert (run / "eval" / "step-000002" / "trained.png").is_file()
    proc = run_cli("eval", str(run), "--compare", "base", "--max-prompts", "4", "--samples", "2",
                   "--reward", "color", "--reward", "jpeg:0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained - base" in proc.stdout and "jpeg" in proc.stdout  # the table
    result = json.loads((run / "eval" / "step-000002" / "results.json").read_text())
    assert result["step"] == 2 and result["sampler"] == "ode" and result["samples_per_prompt"] == 2
    trained = result["models"]["trained"]
    # the same checkpoint, prompts, seeds and sampler as the evaluation in the run: the same number
    assert trained["summary"]["color"]["mean"] == pytest.approx(rows[1]["eval/reward/mean"], abs=1e-6)
    assert set(result["compare"]) == {"reward", "color", "jpeg"} and result["compare"]["color"]["pairs"] == 8
    assert len(trained["per_prompt"]) == 4 and all(p["prompt"] for p in trained["per_prompt"])
    base = result["models"]["base"]["samples"]
    assert [(s["prompt"], s["seed"]) for s in base] == [(s["prompt"], s["seed"]) for s in trained["samples"]]
    out = run / "eval" / "step-000002"
    assert Image.open(out / "base.png").size == Image.open(out / "trained.png").size


def test_eval_usage_errors(run: Path, tmp_path: Path):
    plain = tmp_path / "plain"
    shutil.copytree(run, plain, ignore=shutil.ignore_patterns(".omnirl.lock"))
    config = plain / "config.yaml"
    config.write_text(config.read_text().replace("prompts: builtin:colors", "prompts: [a red car, a blue cup]"))
    proc = run_cli("eval", str(plain), "--compare", "base")
    assert proc.returncode == 2 and "have no test split to evaluate on" in proc.stderr and "--prompts" in proc.stderr
    proc = run_cli("eval", str(run), "--checkpoint", "7")
    assert proc.returncode == 2 and "Checkpoint '7' not found" in proc.stderr and "step-000002" in proc.stderr
    proc = run_cli("eval", str(tmp_path))
    assert proc.returncode == 2 and "is not an omnirl run directory" in proc.stderr


@pytest.mark.slow
def test_sample_writes_one_file_per_output(run: Path, tmp_path: Path):
    out = tmp_path / "samples"
    proc = run_cli("sample", str(run), "--prompt", "a red car", "--prompt", "a blue cup", "--samples", "2",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in index] == ["a red car", "a red car", "a blue cup", "a blue cup"]
    images = [Image.open(out / r["file"]) for r in index]
    assert all(im.size == (32, 32) and im.format == "PNG" for im in images)
    assert images[0].tobytes() != images[1].tobytes()  # two seeds, two samples


def test_report_is_one_self_contained_page_with_the_curves(run: Path, tmp_path: Path):
    proc = run_cli("report", str(run), "--out", str(tmp_path / "report.html"))
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "report.html").read_text()
    for title in ("Reward (mean", "Held-out evaluation", "KL to the reference", "Clip fraction",
                  "Time split of a step"):
        assert title in page
    assert page.count("data:image/png;base64,") >= 3  # two sample grids, the evaluation grid
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing to fetch
    shot = tmp_path / "report.png"
    if not screenshot(tmp_path / "report.html", shot):
        pytest.skip("chromium is not installed (apt-get install chromium): the page was not rendered")
    image = Image.open(shot).convert("RGB")
    # the curves' blue (#2f6fd0) is drawn: lines and points of the charts
    blue = sum(1 for p in image.getdata() if abs(p[0] - 0x2F) < 12 and abs(p[1] - 0x6F) < 12 and abs(p[2] - 0xD0) < 12)
    assert blue > 500, blue
