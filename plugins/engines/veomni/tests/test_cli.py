"""`omnirl train ... --set train.engine=veomni` with nothing else to do by hand: the run's train workers (Ray) or the
whole inline run continue in the environment `omnirl env build veomni` built, with the project's plugins installed
there by the build and kept in step at each start. FlowGRPO on the tiny Qwen-Image, 2 VeOmni FSDP2 ranks as Ray
train workers (split placement: the rollout worker stays in the project's environment, LoRA weights synced to it
after each update); a driver killed by SIGKILL in the middle of a step, and the same command resumes it bit for bit.
Needs the built environment (marked ``engines``: `.ci/engines`)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engines, pytest.mark.slow]

STEPS = 4
ARGS = ("--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny", "--set", "train.engine=veomni",
        "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4", "--set", "run.threads=1",
        "--set", "run.save_every=2", "--set", "run.sample_every=100")
RAY = ("--executor", "ray", "--set", "run.placement=split", "--set", "run.train_workers=2",
       "--set", "run.worker_cpus=0.5")


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


def _train(run: Path, *extra: str, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([_omnirl(), "train", "-o", str(run), *ARGS, *extra], capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


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
    from omnirl_core.testing import check_killed_run_resumes

    rows = check_killed_run_resumes(tmp_path / "whole", tmp_path / "killed", (*ARGS, *RAY), STEPS,
                                    "pytorch_lora_weights.safetensors")
    assert all(r["logprob/abs_delta_max"] < 1e-5 for r in rows)  # the synced LoRA scores as the trainer's shards
    shards = sorted(p.name for p in (tmp_path / "whole" / "checkpoints" / f"step-{STEPS:06d}" / "shards").glob("rank-*"))
    assert shards == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]


def test_bagel_on_two_veomni_ranks_trains_as_the_torch_engine(environment: Path, tmp_path: Path):
    """BAGEL (FlowGRPO, LoRA): VeOmni wraps its decoder layers and the root, whose ``prompt_kv`` (the prompt's KV
    cache, called outside ``forward``) runs as a registered FSDP forward method; 2 Ray train ranks make the same steps
    as one torch-engine train worker (same placement: split, one rollout worker)."""
    from omnirl_core.testing import run_train

    args = ("--model", "bagel", "--algo", "flowgrpo", "--preset", "tiny", "--steps", "2", "--executor", "ray",
            "--set", "run.placement=split", "--set", "run.worker_cpus=0.5", "--set", "run.threads=1")
    torch_rows = run_train(tmp_path / "torch", *args, "--set", "run.train_workers=1")
    veomni_rows = run_train(tmp_path / "veomni", *args, "--set", "train.engine=veomni", "--set", "run.train_workers=2")
    assert len(torch_rows) == len(veomni_rows) == 2
    for a, b in zip(torch_rows, veomni_rows):
        for key in ("reward/mean", "loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-8), (a["step"], key)
        assert b["logprob/abs_delta_max"] < 1e-5
    shards = sorted(p.name for p in (tmp_path / "veomni" / "checkpoints" / "step-000002" / "shards").glob("rank-*"))
    assert shards == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
