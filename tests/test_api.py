"""The Python API (``omnirl_core.train / evaluate / plan``): what the CLI's commands call, usable from code with the
installed plugins. Each check runs in a fresh interpreter, as a user's script would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .conftest import run_cli

TINY = ["--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny", "--steps", "2",
        "--set", "run.threads=1", "--set", "run.save_every=2", "--set", "rollout.prompts_per_step=2",
        "--set", "rollout.group_size=4"]
CONFIG = {"model": {"name": "qwen-image", "preset": "tiny"}, "algorithm": {"name": "flowgrpo"},
          "run": {"steps": 2, "threads": 1, "save_every": 2}, "rollout": {"prompts_per_step": 2, "group_size": 4}}


def _python(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "OMNIRL_AUTOLOAD": "1"})


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "threads/")) and k != "images_per_s"}
            for r in rows]


def test_train_evaluate_and_plan_from_python_match_the_cli(tmp_path: Path):
    api_dir, cli_dir = tmp_path / "api", tmp_path / "cli"
    config = {**CONFIG, "run": {**CONFIG["run"], "output_dir": str(api_dir)}}
    script = f"""
import json, omnirl_core
run_dir = omnirl_core.train({config!r})
report = omnirl_core.evaluate(run_dir, prompts="builtin:colors", max_prompts=2, samples=1, compare="base")
plan = omnirl_core.plan({CONFIG!r}, device_memory="80GiB")
print(json.dumps({{"run_dir": str(run_dir), "labels": [r.label for r in report.results],
                  "compared": sorted(report.comparison), "path": str(report.path), "fits": plan.fits,
                  "total": plan.as_dict()["groups"][0]["total"]}}))
"""
    proc = _python(script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["run_dir"] == str(api_dir) and (api_dir / "checkpoints" / "step-000002").is_dir()
    assert out["labels"] == ["base", "trained"] and out["compared"] == ["color", "reward"]
    assert Path(out["path"]) == api_dir / "eval" / "step-000002" / "results.json"
    assert out["fits"] is True and out["total"] > 0

    cli = run_cli("train", "-o", str(cli_dir), *TINY)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert _rows(api_dir) == _rows(cli_dir)  # the same run, bit for bit at a fixed thread count


def test_a_bad_config_raises_the_error_the_cli_prints():
    proc = _python("""
import omnirl_core
from omnirl_core.errors import OmnirlError
try:
    omnirl_core.plan({"model": {"name": "qwen-imgae"}, "algorithm": {"name": "flowgrpo"}})
except OmnirlError as err:
    print(err.exit_code, err.render())
""", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("3 Unknown model 'qwen-imgae'. Did you mean 'qwen-image'?"), proc.stdout
