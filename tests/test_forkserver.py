"""The test fork server (``omnirl_core.testing.forkserver``) runs a command as a fresh process would: the same
output, exit status, working directory, argv, environment and results, side by side with a plain subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnirl_core.testing import forkserver

PROBE = r'''
import json, os, signal, sys
mode = sys.argv[1]
print(json.dumps({"cwd": os.getcwd(), "argv": sys.argv, "path0": sys.path[0], "name": __name__,
                  "probe": os.environ.get("OMNIRL_PROBE"), "test": os.environ.get("PYTEST_CURRENT_TEST"),
                  "stdin": sys.stdin.read(), "torch_loaded": "torch" in sys.modules}))
sys.stdout.flush()
print("to stderr", file=sys.stderr)
if mode == "exit":
    sys.exit(3)
if mode == "raise":
    raise ValueError("probe failure")
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
'''


def _both(script: Path, mode: str, env: dict[str, str], cwd: Path):
    served = forkserver.run_script(script, [mode], env=env, cwd=cwd, timeout=120, fork=True)
    plain = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, env=env, cwd=cwd,
                           timeout=120, check=False, stdin=subprocess.DEVNULL)
    return served, plain


@pytest.mark.parametrize("mode, code", [("ok", 0), ("exit", 3), ("raise", 1), ("kill", -9)])
def test_a_script_sees_and_ends_as_in_a_fresh_process(tmp_path: Path, mode: str, code: int):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "OMNIRL_PROBE": "x"}
    served, plain = _both(script, mode, env, work)
    assert served.returncode == plain.returncode == code, (served.stderr, plain.stderr)
    seen, want = json.loads(served.stdout), json.loads(plain.stdout)
    assert seen.pop("torch_loaded") and not want.pop("torch_loaded")  # the one difference: imports done before
    assert seen == want
    assert seen["cwd"] == str(work) and seen["probe"] == "x" and seen["name"] == "__main__"
    assert seen["test"] == os.environ["PYTEST_CURRENT_TEST"]
    assert served.stderr.splitlines()[0] == "to stderr"
    if mode == "raise":
        assert served.stderr.splitlines()[-1] == plain.stderr.splitlines()[-1] == "ValueError: probe failure"


def test_another_environment_gets_its_own_server(tmp_path: Path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    for value in ("x", "y"):  # "x": the server of the tests above
        out = forkserver.run_script(script, ["ok"], env={**os.environ, "OMNIRL_PROBE": value}, timeout=120, fork=True)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["probe"] == value


def test_a_timeout_kills_the_command(tmp_path: Path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired) as err:
        forkserver.run_script(script, [], env={**os.environ, "OMNIRL_PROBE": "x"}, timeout=3, fork=True)
    assert "started" in err.value.output


@pytest.mark.slow
def test_a_training_run_gives_the_same_rows_and_messages_as_a_plain_process(tmp_path: Path):
    # run.threads=fixed: the adaptive default sizes the pool to the load each process meets, and another thread
    # count sums in another order (CI saw rollout/threads 2 and 1, and rows that differed in the 7th digit)
    args = ["train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny", "--steps", "2",
            "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4", "--set", "run.threads=fixed"]
    served = forkserver.run_omnirl([*args, "-o", str(tmp_path / "served")], timeout=600, fork=True)
    plain = subprocess.run([str(forkserver.omnirl_script()), *args, "-o", str(tmp_path / "plain")],
                           capture_output=True, text=True, timeout=600, check=False)
    assert served.returncode == plain.returncode == 0, (served.stderr[-2000:], plain.stderr[-2000:])

    def rows(run: Path) -> list[dict]:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "images_per_s", "threads/"))}
                for line in lines]

    assert rows(tmp_path / "served") == rows(tmp_path / "plain")
    def said(stderr: str, name: str) -> list[str]:  # what the machine's load decides is left out: the thread notice
        return [line.replace(name, "RUN") for line in stderr.splitlines() if "the CPUs are shared" not in line]

    assert said(served.stderr, "served") == said(plain.stderr, "plain")
    threads = [json.loads((tmp_path / run / "runtime.json").read_text())["threads"] for run in ("served", "plain")]
    assert threads[0] == threads[1]  # the same thread policy, applied before torch loaded in both
