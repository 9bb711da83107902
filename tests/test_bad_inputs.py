"""Bad inputs and damaged run directories: each gets a clear error (what, where, how to fix) and the exit code
the README's table names; nothing is lost or silently wrong. The rows of that table point here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import run_cli

BASE = ["train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny"]
SMALL = ["--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4", "--set", "run.save_every=2"]


def _clean(proc) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--reward", "color:nan"], "the weight must be a finite number, not nan"),
    (["--reward", "color:inf"], "the weight must be a finite number, not inf"),
    (["--reward", "jpeg:abc"], "--reward jpeg:abc: the weight 'abc' is not a number"),
    (["--set", "rewards.0.weight=.nan"], "rewards.0.weight: Input should be a finite number"),
    (["--set", "rollout.group_size=1"], "rollout.group_size = 1, but 'flowgrpo' compares samples within a group"),
    (["--set", "rollout.num_steps=1"], "rollout.num_steps: Input should be greater than or equal to 2"),
    (["--set", "algorithm.options.noise_level=0"], "algorithm.options.noise_level: Input should be greater than 0"),
    (["--set", "rewards.5.name=jpeg"], "rewards.5: index out of range"),
])
def test_bad_settings_are_usage_errors(args, message):
    proc = run_cli(*BASE, *args, "--dry-run")
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    _clean(proc)


def test_reward_weights_that_train_nothing_are_warned_about():
    proc = run_cli(*BASE, "--reward", "color:0", "--dry-run")
    assert proc.returncode == 0 and "reward 'color' has weight 0" in proc.stderr
    proc = run_cli(*BASE, "--reward", "color:1", "--reward", "jpeg:-1", "--dry-run")
    assert proc.returncode == 0 and "the reward weights sum to 0 (color=1, jpeg=-1)" in proc.stderr


def test_set_patches_a_reward_given_by_flag():
    proc = run_cli(*BASE, "--reward", "color", "--set", "rewards.0.weight=2", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "- color x2.0" in proc.stdout


@pytest.mark.parametrize(("content", "message"), [
    (b'{"prompt": null}\n', "prompts.jsonl:1: a record needs a non-empty text 'prompt' ('prompt' is None)"),
    (b'{"prompt": "a cat"}\n{"text": "no prompt"}\n', ("prompts.jsonl:2: a record needs a non-empty text 'prompt' "
                                                       "(no 'prompt' key)")),
    (b'{"prompt": "a cat"}\n{broken\n', "prompts.jsonl:2: not valid JSON"),
    (b'["a list"]\n', "prompts.jsonl:1: expected a JSON object"),
])
def test_bad_prompt_records_name_file_and_line(tmp_path, content, message):
    data = tmp_path / "prompts.jsonl"
    data.write_bytes(content)
    proc = run_cli(*BASE, "--set", f"data.prompts={data}", "--steps", "1", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    _clean(proc)


def test_a_prompt_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    data = tmp_path / "prompts.txt"
    data.write_bytes("a red cat\nun caf\xe9 bleu\n".encode("latin-1"))
    proc = run_cli(*BASE, "--set", f"data.prompts={data}", "--steps", "1", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert "prompts.txt:2: not UTF-8 text" in proc.stderr and "iconv" in proc.stderr
    _clean(proc)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 2-step run with its checkpoint at step 2: the damaged copies below start from it."""
    out = tmp_path_factory.mktemp("run") / "run"
    proc = run_cli(*BASE, *SMALL, "--steps", "2", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(run, out)
    (out / ".omnirl.lock").unlink(missing_ok=True)
    return out


@pytest.mark.parametrize(("damage", "file"), [
    ("flip", "pytorch_lora_weights.safetensors"),  # bytes changed, header intact
    ("truncate", "pytorch_lora_weights.safetensors"),
    ("truncate", "trainer_state.json"),
    ("truncate", "optimizer.json"),
    ("truncate", "optimizer.safetensors"),
    ("delete", "optimizer.json"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file(finished_run, tmp_path, damage, file):
    out = _copy(finished_run, tmp_path)
    path = out / "checkpoints" / "step-000002" / file
    data = path.read_bytes()
    if damage == "flip":
        path.write_bytes(data[:-64] + bytes(b ^ 0xFF for b in data[-64:]))
    elif damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.unlink()
    proc = run_cli(*BASE, *SMALL, "--steps", "4", "--output-dir", str(out))
    assert proc.returncode == 2, proc.stderr
    assert "step-000002 is damaged" in proc.stderr and file in proc.stderr
    assert "missing" in proc.stderr if damage == "delete" else "differs from its checksum" in proc.stderr
    _clean(proc)
    assert not (out / "checkpoints" / "step-000004").exists()  # nothing trained on top of it


def test_resume_without_the_latest_pointer_and_with_leftovers(finished_run, tmp_path):
    out = _copy(finished_run, tmp_path)
    (out / "checkpoints" / "latest").unlink()
    leftover = out / "checkpoints" / ".tmp-step-000003-abc"
    leftover.mkdir()
    (leftover / "pytorch_lora_weights.safetensors").write_bytes(b"half")
    (out / ".metrics.jsonl-xyz").write_text("torn")
    rows_before = (out / "metrics.jsonl").read_text()
    with open(out / "metrics.jsonl", "a") as fh:  # a row of a step that never reached a checkpoint
        fh.write(json.dumps({"step": 3, "reward/mean": 0.5}) + "\n")
    proc = run_cli(*BASE, *SMALL, "--steps", "3", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "resuming" in proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (out / "metrics.jsonl").read_text().startswith(rows_before)
    assert not leftover.exists() and not (out / ".metrics.jsonl-xyz").exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000003"


def test_a_second_process_on_the_same_run_directory_is_refused(finished_run, tmp_path):
    out = _copy(finished_run, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from omnirl_core.rundir.rundir import RunDir; "
        f"RunDir(Path({str(out)!r})).lock(); print('locked', flush=True); time.sleep(120)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = run_cli(*BASE, *SMALL, "--steps", "3", "--output-dir", str(out))
        assert proc.returncode == 2
        assert f"is in use by another omnirl process (pid {holder.pid})" in proc.stderr
        assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    finally:
        holder.kill()
        holder.wait()
    # the lock goes with its process, kill -9 included
    proc = run_cli(*BASE, *SMALL, "--steps", "3", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr


def test_a_restart_before_the_first_checkpoint_starts_over_without_duplicate_rows(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    exe = Path(sys.executable).with_name("omnirl")
    proc = subprocess.Popen([str(exe), *BASE, *SMALL, "--set", "run.save_every=100", "--steps", "50",
                             "--output-dir", str(out)], stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        rows = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").is_file() else []
        if len(rows) >= 2:
            break
        time.sleep(0.2)
    proc.kill()  # SIGKILL: no checkpoint was ever written
    proc.wait()
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").glob("step-*"))
    again = run_cli(*BASE, *SMALL, "--set", "run.save_every=100", "--steps", "2", "--output-dir", str(out))
    assert again.returncode == 0, again.stderr
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_step_too_large_for_this_machine_is_refused_up_front_with_the_numbers():
    proc = run_cli(*BASE, "--set", "rollout.height=2048", "--set", "rollout.width=2048", "--set",
                   "rollout.group_size=64", "--set", "rollout.prompts_per_step=64", "--steps", "1",
                   "--output-dir", "/nonexistent/never-created")
    assert proc.returncode == 2, proc.stderr
    # the memory plan of the tiny architecture on this machine's RAM, the step's samples included (issue 30)
    assert "does not fit in the" in proc.stderr and "of RAM available now" in proc.stderr
    assert "samples of a step (outputs, trajectories)" in proc.stderr
    _clean(proc)


def test_the_memory_floor_counts_outputs_and_trajectories():
    from omnirl_core.config import RunConfig
    from omnirl_core.errors import ConfigError
    from omnirl_core.planning.memory import check_rollout_memory
    from omnirl_core.planning.planner import rollout_state_bytes

    cfg = RunConfig.model_validate({"rollout": {"height": 64, "width": 64, "num_steps": 9,
                                                "prompts_per_step": 2, "group_size": 4}})
    need = rollout_state_bytes(cfg)
    assert need["outputs"] == 8 * 3 * 64 * 64 * 4 and need["trajectories"] == 8 * 10 * 64 * 16 * 4
    assert check_rollout_memory(cfg, available=10 * need["total"]) == need
    with pytest.raises(ConfigError, match="more than the"):
        check_rollout_memory(cfg, available=need["total"])


def test_prompt_data_without_the_field_a_reward_reads_is_refused_at_dry_run(tmp_path):
    data = tmp_path / "questions.jsonl"
    data.write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n" + json.dumps({"prompt": "3+3?"}) + "\n")
    args = ["train", "--model", "qwen3-omni", "--algo", "gspo", "--preset", "tiny", "--reward", "answer-match",
            "--set", f"data.prompts={data}", "--dry-run"]
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert "lacks fields the rewards need" in proc.stderr
    assert "reward 'answer-match' reads the field 'answer', which 1 of 2 train record(s) lack" in proc.stderr
    _clean(proc)
    # the field an option names is the one checked
    ok = run_cli(*args[:-1], "--set", "rewards.0.options.answer_key=prompt", "--dry-run")
    assert ok.returncode == 0, ok.stderr


def test_media_inputs_the_model_cannot_read_are_refused_at_dry_run(tmp_path):
    """qwen-image reads no image inputs: a record with one would be ignored without a word."""
    from PIL import Image

    Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / "apple.png")  # a real picture: the data layer reads it
    data = tmp_path / "edits.jsonl"
    data.write_text(json.dumps({"prompt": "a red apple"}) + "\n"
                    + json.dumps({"prompt": "make it blue", "image": str(tmp_path / "apple.png")}) + "\n")
    proc = run_cli(*BASE, "--set", f"data.prompts={data}", "--dry-run")
    assert proc.returncode == 2, proc.stderr
    assert "has 'image' inputs (" in proc.stderr and "prompt 'make it blue'" in proc.stderr
    assert "does not read image inputs" in proc.stderr and "image-input" in proc.stderr
    _clean(proc)
