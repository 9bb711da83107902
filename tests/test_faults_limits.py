"""Issue 30, limits and the first lines of a run: a rollout too large for the machine or for the model is refused
alike by ``--dry-run``, the run and ``omnirl plan`` (exit 2, the planner's numbers for the device in use); a stop
signal ends a run inside one long native call of its rollout; a recipe's Ray runtime environments need a flag;
the main job's data holds a test split; ``--preset tiny`` reaches the rewards; ``omnirl plan`` plans the tiny
architecture and says what to change, or that nothing it tries fits."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .conftest import run_cli

FIXTURES = Path(__file__).parent / "fixture_plugins"
MODEL = ("--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny")
BASE = ("train", *MODEL)


def _need(proc: subprocess.CompletedProcess) -> float:
    found = re.search(r"actor\+rollout: ([0-9.]+) GiB per device", proc.stderr)
    assert found, proc.stderr[-3000:]
    return float(found.group(1))


def test_a_rollout_too_large_for_the_machine_is_refused_alike_by_the_dry_run_the_run_and_the_plan(tmp_path):
    big = ("--set", "rollout.height=4096", "--set", "rollout.width=4096", "--set", "rollout.group_size=64",
           "--device", "cpu")
    out = tmp_path / "run"
    dry = run_cli(*BASE, *big, "--output-dir", str(out), "--dry-run")
    real = run_cli(*BASE, *big, "--output-dir", str(out))
    plan = run_cli("plan", *MODEL, *big)
    for proc in (dry, real, plan):
        assert proc.returncode == 2, proc.stderr[-3000:]
        first = proc.stderr.splitlines()[0]
        assert "The run (qwen-image, flowgrpo" in first and "does not fit in the" in first
        assert "of RAM available now" in first and "Traceback" not in proc.stderr
        assert "fits with" in proc.stderr or "no single change omnirl tries fits" in proc.stderr
    # one check, the planner's, for the tiny architecture the run loads: the same need three times
    assert _need(dry) == _need(real) == _need(plan) > 100
    assert "VAE decode of 32" in plan.stdout and "samples of a step" in plan.stdout
    assert not out.exists()  # refused before the run directory is touched


def test_a_size_beyond_the_models_position_range_is_refused_before_anything_loads(tmp_path):
    for extra in (("--dry-run",), ()):
        proc = run_cli(*BASE, "--set", "rollout.height=100000", "--output-dir", str(tmp_path / "run"), *extra)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "cannot do" in proc.stderr.splitlines()[0]
        assert "rollout.height/width = 100000x32" in proc.stderr and "at most 49152 pixels a side" in proc.stderr
        assert "RuntimeError" not in proc.stderr and not (tmp_path / "run").exists()


def test_ctrl_c_ends_a_run_inside_one_long_native_call_of_its_rollout(tmp_path):
    """Step 2's VAE decode starts with one native call of minutes (fixture ``slow_model``): the stop signal ends
    the run at once, step 1 is saved, nothing of step 2; the rollout says how far it is meanwhile."""
    out = tmp_path / "run"
    exe = Path(sys.executable).with_name("omnirl")
    env = {**os.environ, "PYTHONPATH": str(FIXTURES), "OMNIRL_PLUGINS": "slow_model", "SLOW_MODEL_FROM_DECODE": "2"}
    proc = subprocess.Popen([str(exe), "train", "--model", "slow-qwen-image", "--algo", "flowgrpo", "--preset", "tiny",
                             "--steps", "3", "--output-dir", str(out)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600
        while not (out / "metrics.jsonl").is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # step 1 done; step 2's rollout runs
        assert proc.poll() is None, "".join(lines)[-3000:]
        deadline = time.monotonic() + 60
        while not any("rollout:" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        proc.wait(timeout=60)
        waited = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    stderr = "".join(lines)
    assert proc.returncode == 130, stderr[-3000:]
    assert waited < 60
    assert "decoding 32 sample(s), running for" in stderr  # the progress of the long call
    assert "interrupted" in stderr and "latest checkpoint step-000001" in stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-000001"]


def test_a_recipes_ray_runtime_environments_need_a_flag(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: {name: qwen-image, preset: tiny}\nalgorithm: {name: flowgrpo}\n"
                      "run:\n  executor: ray\n  ray_runtime_envs:\n    reward:\n      py_executable: /bin/sh -c true\n"
                      "      env_vars: {LD_PRELOAD: /tmp/evil.so}\n")
    out = ("--output-dir", str(tmp_path / "run"), "--dry-run")
    refused = run_cli("train", "--recipe", str(recipe), *out)
    assert refused.returncode == 2, refused.stderr[-3000:]
    first, *rest = refused.stderr.splitlines()
    assert "sets Ray runtime environments" in first and "--allow-recipe-environments" in first
    assert "run.ray_runtime_envs.reward" in refused.stderr and "py_executable" in refused.stderr
    assert "/tmp/evil.so" not in refused.stderr  # variables by name only
    assert "--allow-recipe-environments" in rest[-1]
    allowed = run_cli("train", "--recipe", str(recipe), "--allow-recipe-environments", *out)
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    inline = run_cli("train", "--recipe", str(recipe), "--executor", "inline", *out)  # nothing would use them
    assert inline.returncode == 0, inline.stderr[-3000:]
    own = run_cli(*BASE, "--executor", "ray", "--set", "run.ray_runtime_envs.reward.env_vars.X=1", *out)
    assert own.returncode == 0, own.stderr[-3000:]  # the user's own --set


def test_the_main_jobs_run_has_held_out_prompts_and_evaluates(tmp_path):
    run = tmp_path / "run"
    trained = run_cli(*BASE, "--steps", "1", "--set", "rollout.group_size=2", "--output-dir", str(run))
    assert trained.returncode == 0, trained.stderr[-3000:]
    proc = run_cli("eval", str(run), "--samples", "1", "--max-prompts", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((run / "eval" / "step-000001" / "results.json").read_text())
    prompts = [p["prompt"] for p in result["models"]["trained"]["per_prompt"]]
    assert prompts == ["a red circle", "a green circle"]  # the colour reward's held-out prompts, not its training squares


def test_preset_tiny_reaches_every_reward_that_has_a_tiny_preset():
    proc = run_cli("config", "show", *MODEL, "--reward", "pickscore", "--reward", "color", "--format", "json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = json.loads(proc.stdout)["rewards"]
    assert rewards[0]["options"]["preset"] == "tiny" and "preset" not in rewards[1]["options"]
    assert "--preset tiny applies to reward 'pickscore' too (rewards.0.options.preset=tiny" in proc.stderr
    real = run_cli("config", "show", *MODEL, "--reward", "pickscore", "--set", "rewards.0.options.preset=null",
                   "--format", "json")
    assert real.returncode == 0, real.stderr[-3000:]
    assert json.loads(real.stdout)["rewards"][0]["options"]["preset"] is None and "applies to" not in real.stderr


def test_the_tiny_preset_plans_its_own_architecture_and_a_released_only_plan_says_so():
    tiny = run_cli("plan", *MODEL, "--device-memory", "80GiB", "--format", "json")
    assert tiny.returncode == 0, tiny.stderr[-3000:]
    plan = json.loads(tiny.stdout)
    rows = plan["groups"][0]["rows"]
    assert plan["architecture"] == "tiny" and rows["weights/transformer"] < 2**20  # not the 38 GiB of the 20B model
    sd = run_cli("plan", "--model", "sd3.5", "--algo", "flowgrpo", "--preset", "tiny", "--device-memory", "80GiB")
    assert sd.returncode in (0, 2), sd.stderr[-3000:]
    assert "these are the released, full-size sd3.5's numbers, not the preset 'tiny'" in sd.stdout


def test_a_plan_that_nothing_tried_makes_fit_says_so_and_lists_what_was_tried():
    proc = run_cli("plan", *MODEL, "--device-memory", "1MiB")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "does not fit in 1 MiB per device" in proc.stderr.splitlines()[0]
    assert "no single change omnirl tries fits, nor all of them together (tried: " in proc.stderr
    assert "train.micro_batch_size=" in proc.stderr and "Apply one of the changes above" not in proc.stderr
