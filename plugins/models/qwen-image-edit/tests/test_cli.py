"""The editing job end to end through the real CLI on the tiny preset: `omnirl train` on builtin:edits with rewards that
read the source, then `omnirl sample` and `omnirl report`, each showing source, instruction and result side by side
(the report rendered in Chromium where it is installed)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from omnirl_core import testing
from omnirl_core.testing.forkserver import run_omnirl


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_omnirl(list(args), env=dict(os.environ), cwd=cwd, timeout=600)


@pytest.mark.slow  # three CLI commands (a 2-step run), Chromium: about 35 s on 2 cores
def test_train_sample_and_report_show_each_source_beside_its_results(tmp_path: Path):
    run = tmp_path / "run"
    proc = _cli("train", "--model", "qwen-image-edit", "--algo", "flowgrpo", "--preset", "tiny", "--steps", "2",
                "--set", "data.prompts=builtin:edits", "--set", "rollout.prompts_per_step=2",
                "--set", "rollout.group_size=4", "--reward", "edit-color", "--reward", "edit-consistency:0.5",
                "--set", "run.sample_every=1", "--set", "run.eval_every=2", "--set", "run.eval_prompts=2",
                "--set", "run.eval_samples=1", "--output-dir", str(run), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(np.isfinite(r["reward/edit-color"]) and np.isfinite(r["reward/edit-consistency"])
                                  for r in rows)
    assert rows[0]["logprob/abs_delta_max"] <= 1e-5  # the trainer re-evaluated with the rollout's conditioning
    results = json.loads((run / "eval" / "step-000002" / "results.json").read_text())
    evaluated = results["models"]["trained"]["samples"]
    assert all(Path(s["source"][0]).is_file() for s in evaluated)  # each scored sample names its source

    # the sample grid opens each row with the row's source: its first tile is the source, enlarged
    grid = Image.open(run / "samples" / "step-000001.png").convert("RGB")
    tile = grid.height // 2 - 14  # two rows of (label + tile)
    first = np.asarray(grid.crop((0, 14, tile, 14 + tile)))
    assert first.std() > 0 and len({tuple(p) for p in first.reshape(-1, 3)}) <= 4  # flat colours: a source

    records = tmp_path / "two.jsonl"
    sources = Path(results["models"]["trained"]["samples"][0]["source"][0]).parent
    records.write_text("".join(json.dumps({"prompt": f"make the square {c}", "image": str(sources / "0000.png")}) + "\n"
                               for c in ("red", "blue")))
    out = tmp_path / "samples"
    proc = _cli("sample", str(run), "--prompts", str(records), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["side_by_side"] for r in index] == ["0000-edit.png", "0001-edit.png"]
    pair = Image.open(out / "0000-edit.png").convert("RGB")
    source = Image.open(sources / "0000.png").convert("RGB").resize((256, 256), Image.Resampling.NEAREST)
    assert pair.size == (512, 270) and pair.crop((0, 14, 256, 270)).tobytes() == source.tobytes()

    proc = _cli("report", str(run), "--out", str(tmp_path / "report.html"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 3  # the sample grids and the evaluation grid
    shot = tmp_path / "report.png"
    if not testing.screenshot(tmp_path / "report.html", shot, 1200, 3000):
        pytest.skip("chromium is not installed (apt-get install chromium): the page was not rendered")
    shown = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3).astype(int)
    colour = np.asarray(Image.open(evaluated[0]["source"][0]).convert("RGB")).reshape(-1, 3).astype(int)
    shape = colour[(colour != colour[0]).any(axis=1)][0]  # the evaluated source's shape (its background: the corner's)
    assert (np.abs(shown - shape).sum(axis=1) == 0).sum() > 100  # that source shows on the rendered page
