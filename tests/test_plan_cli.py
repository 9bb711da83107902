"""``omnirl plan`` through the real CLI: the refusal of a run that does not fit (exit 2, the numbers, the changes
that fit) and the README's one-GPU recipe that does."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_cli


def test_omnirl_plan_refuses_the_default_qwen_image_run_on_one_80gb_gpu_and_names_what_fits():
    proc = run_cli("plan", "--model", "qwen-image", "--algo", "flowgrpo", "--reward", "jpeg", "--device", "cuda",
                   "--device-memory", "80GiB")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "weights/transformer" in proc.stdout and "DOES NOT FIT" in proc.stdout
    assert "does not fit in 80 GiB per device" in proc.stderr
    assert "fits with" in proc.stderr and "gradient_checkpointing=true" in proc.stderr
    fixed = run_cli("plan", "--recipe", "recipes/qwen-image/flowgrpo-lora-1gpu.yaml", "--device-memory", "80GiB",
                    "--format", "json", cwd=Path(__file__).resolve().parents[1])
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    plan = json.loads(fixed.stdout)
    assert plan["fits"] and plan["dtype"] == "bfloat16"
    assert plan["groups"][0]["total"] <= plan["budget"]
