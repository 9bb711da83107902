"""Crash consistency: a tiny run killed at many points (SIGKILL, SIGINT, SIGTERM), then resumed with the same
command, ends with the same weights, optimizer state and metrics rows as a run that was never interrupted.

Every killed run is a real ``omnirl train`` process that sends the signal to itself at a point of the run
(``crash_driver.py``), forked by the test fork server (``omnirl_core.testing.forkserver``), which has imported
torch and co. already: 50 processes, and each would spend most of its time importing. Compared after the resume, bit for bit: the final LoRA weights, every optimizer
tensor and its metadata, the algorithm's state, and every value of every metrics row except the wall-clock
timings (``time/*``, ``images_per_s``), which no two runs share. Each step has exactly one row.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors.torch import load_file

from omnirl_core.testing.forkserver import run_omnirl, run_script

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("crash_driver.py")
STEPS = 6
ARGS = ["train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny", "--set", "run.save_every=2",
        "--set", "train.minibatches=2", "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
        "--set", "run.sample_every=100"]
# (point, step, signal); 'load' and 'prepare' hit a run that resumes from a finished 4-step run
POINTS = [
    ("collect", 1, "KILL"), ("reward", 1, "KILL"), ("collect", 3, "KILL"), ("optimizer", 3, "KILL"),
    ("optimizer", 4, "KILL"), ("sync", 2, "KILL"), ("row", 2, "KILL"), ("row", 4, "KILL"),
    ("ckpt-write", 2, "KILL"), ("ckpt-write", 4, "KILL"), ("ckpt-latest", 4, "KILL"), ("load", 0, "KILL"),
    ("prepare", 0, "KILL"),
    ("collect", 1, "INT"), ("reward", 3, "INT"), ("optimizer", 2, "INT"), ("optimizer", 3, "INT"),
    ("optimizer-2x", 3, "INT"), ("sync", 3, "INT"), ("row", 4, "INT"), ("ckpt-write", 4, "INT"),
    ("ckpt-latest", 2, "INT"), ("load", 0, "INT"),
    ("optimizer", 3, "TERM"),
]
TIMING = ("time/", "images_per_s", "threads/")  # measured on the machine: its load, not the run
EXIT = {"KILL": -9, "INT": 130, "TERM": 143}


def _env() -> dict[str, str]:
    # one thread per run: two runs share the two cores, and every run computes with the same thread count
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _omnirl(out: Path, steps: int, *, crash: tuple[str, int, str] | None = None) -> subprocess.CompletedProcess:
    args = [*ARGS, "--steps", str(steps), "--output-dir", str(out)]
    if crash is None:
        return run_omnirl(args, env=_env(), timeout=600)
    return run_script(DRIVER, [crash[0], str(crash[1]), crash[2], "--", *args], env=_env(), timeout=600)


def _final(out: Path) -> dict[str, object]:
    ckpt = out / "checkpoints" / f"step-{STEPS:06d}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "lora": load_file(ckpt / "pytorch_lora_weights.safetensors"),
        "optimizer": load_file(ckpt / "optimizer.safetensors"),
        "optimizer_meta": (ckpt / "optimizer.json").read_text(),
        "steps": [r["step"] for r in rows],
        "rows": [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows],
    }


def _same(a: dict[str, object], b: dict[str, object]) -> list[str]:
    import torch

    problems = []
    for key in ("lora", "optimizer"):
        ta, tb = a[key], b[key]
        if set(ta) != set(tb):
            problems.append(f"{key}: different tensors")
        problems += [f"{key}.{n} differs" for n in ta if n in tb and not torch.equal(ta[n], tb[n])]
    for key in ("optimizer_meta", "steps"):
        if a[key] != b[key]:
            problems.append(f"{key}: {a[key]} vs {b[key]}")
    for ra, rb in zip(a["rows"], b["rows"]):
        diff = sorted(k for k in set(ra) | set(rb) if json.dumps(ra.get(k)) != json.dumps(rb.get(k)))
        if diff:
            problems.append(f"row {ra.get('step')}: {diff}")
    return problems


def _crash_and_resume(root: Path, point: tuple[str, int, str]) -> tuple[str, list[str]]:
    name, step, sig = point
    out = root / f"{name}-{step}-{sig}"
    if name in ("load", "prepare"):
        first = _omnirl(out, 4)
        assert first.returncode == 0, first.stderr
    killed = _omnirl(out, STEPS, crash=point)
    problems = []
    if killed.returncode != EXIT[sig]:
        problems.append(f"exit code {killed.returncode}, expected {EXIT[sig]}: {killed.stderr[-600:]}")
    if sig != "KILL" and "interrupted" not in killed.stderr:
        problems.append(f"no 'interrupted' message: {killed.stderr[-600:]}")
    if "Traceback" in killed.stderr:
        problems.append(f"traceback: {killed.stderr[-600:]}")
    resumed = _omnirl(out, STEPS)
    if resumed.returncode != 0:
        return str(out), [*problems, f"resume failed: {resumed.stderr[-800:]}"]
    leftovers = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    if leftovers:
        problems.append(f"partial writes left: {leftovers}")
    return str(out), problems


def test_kill_at_every_point_then_resume_equals_an_uninterrupted_run(tmp_path):
    reference = _omnirl(tmp_path / "reference", STEPS)
    assert reference.returncode == 0, reference.stderr
    want = _final(tmp_path / "reference")
    assert want["steps"] == list(range(1, STEPS + 1))
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda p: _crash_and_resume(tmp_path, p), POINTS))
    failures = []
    for point, (out, problems) in zip(POINTS, results):
        if not problems:
            problems = _same(want, _final(Path(out)))
        if problems:
            failures.append(f"{point}: " + "; ".join(problems))
    assert len(POINTS) >= 20
    assert not failures, "\n".join(failures)
