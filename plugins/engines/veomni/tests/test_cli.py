"""`omnirl train ... --set train.engine=veomni` with nothing else to do by hand: the run's train workers (Ray) or the
whole inline run continue in the environment `omnirl env build veomni` built, with the project's plugins installed
there by the build and kept in step at each start. FlowGRPO on the tiny Qwen-Image, 2 VeOmni FSDP2 ranks as Ray
train workers (split placement: the rollout worker stays in the project's environment, LoRA weights synced to it
after each update); a driver killed by SIGKILL in the middle of a step, and the same command resumes it bit for bit.
Needs the built environment (marked ``engines``: `.ci/engines`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engines, pytest.mark.slow]

STEPS = 4
ARGS = ("--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny", "--set", "train.engine=veomni",
        "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4", "--set", "run.threads=1",
        "--set", "run.save_every=2", "--set", "run.sample_every=100")
RAY = ("--executor", "ray", "--set", "run.placement=split", "--set", "run.train_workers=2",
       "--set", "run.worker_cpus=0.5")
TIMED = ("time/", "images_per_s", "threads/")  # measured on the machine: its load, not the run


@pytest.fixture(scope="module")
def environment() -> Path:
    from omnirl_core.serving.envs import component_environment, environment_python
    from omnirl_core.testing import require_engine_environment

    require_engine_environment("veomni", "cpu")
    return environment_python(component_environment("veomni", "cpu"))


def _omnirl() -> str:
    from omnirl_core.testing.forkserver import omnirl_script

    return str(omnirl_script())


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMED)} for r in rows]


def _train(run: Path, *extra: str, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([_omnirl(), "train", "-o", str(run), *ARGS, *extra], capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def _weights(run: Path, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "checkpoints" / f"step-{step:06d}" / "pytorch_lora_weights.safetensors"))


def test_the_environment_holds_the_projects_plugins(environment: Path):
    """The build installed the run's plugins there (entry points included), at the project's versions."""
    from omnirl_core.serving.envs import project_plugins

    listed = subprocess.run([str(environment), "-c", ("import importlib.metadata as m, json; print(json.dumps("
                             "sorted({e.dist.name for e in m.entry_points(group='omnirl.plugins')})))")],
                            capture_output=True, text=True, check=True, env={k: v for k, v in os.environ.items()
                                                                            if k != "PYTHONPATH"})
    there = set(json.loads(listed.stdout))
    assert {"omnirl-plugin-qwen-image", "omnirl-plugin-flowgrpo", "omnirl-plugin-veomni"} <= there
    assert set(project_plugins()) <= there


def test_an_inline_run_continues_in_the_environment(environment: Path, tmp_path: Path):
    """Inline: the command re-executes itself in the environment's interpreter (one rank: VeOmni's optimizer and
    clipping on the unwrapped module, see the README) and trains."""
    proc = _train(tmp_path / "inline", "--steps", "2")
    assert "runs in its own environment 'veomni': continuing there" in proc.stderr
    rows = _rows(tmp_path / "inline")
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["grad_norm"] > 0
    assert rows[0]["logprob/abs_delta_max"] < 1e-5


def test_two_ray_ranks_train_and_a_run_killed_mid_step_resumes_bit_for_bit(environment: Path, tmp_path: Path):
    whole = tmp_path / "whole"
    _train(whole, *RAY, "--steps", str(STEPS))
    rows = _rows(whole)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["logprob/abs_delta_max"] < 1e-5 for r in rows)  # the synced LoRA scores as the trainer's shards
    shards = sorted(p.name for p in (whole / "checkpoints" / f"step-{STEPS:06d}" / "shards").glob("rank-*"))
    assert shards == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]

    killed = tmp_path / "killed"
    proc = subprocess.Popen([_omnirl(), "train", "-o", str(killed), *ARGS, *RAY, "--steps", str(STEPS)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    latest = killed / "checkpoints" / "latest"
    deadline = time.monotonic() + 600
    # the moment step 2's checkpoint is complete, step 3 begins (a step takes 0.2-0.5 s here): kill the driver then
    while proc.poll() is None and time.monotonic() < deadline:
        if latest.is_file() and latest.read_text().strip() == "step-000002":
            break
        time.sleep(0.005)
    assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert [r["step"] for r in _rows(killed)] == [1, 2], "the kill did not land inside step 3"

    resumed = _train(killed, *RAY, "--steps", str(STEPS))
    assert "resuming" in resumed.stderr
    assert _untimed(_rows(killed)) == _untimed(rows)
    a, b = _weights(whole, STEPS), _weights(killed, STEPS)
    assert a and a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
