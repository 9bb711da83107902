"""benchmarks/gpu_check.py keeps working between GPU sessions: the same script at tiny size on the CPU (gloo instead
of nccl) trains, and writes the figures the GPU run reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_at_tiny_size_on_cpu(tmp_path: Path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--size", "tiny", "--device",
                           "cpu", "--steps", "2", "--out", str(out)], capture_output=True, text=True, timeout=600,
                          check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["steps"] == 2 and result["samples_per_step"] == 8
    assert result["img_per_gpu_s"] > 0 and result["step_s"] > 0
    assert result["split_s"]["rollout"] > 0 and result["split_s"]["train"] > 0
    assert len(result["reward_mean"]) == 2 and all(r < 0 for r in result["reward_mean"])  # minus JPEG kB
