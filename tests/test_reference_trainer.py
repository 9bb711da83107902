"""benchmarks/reference_trainer.py keeps working without flow_grpo at hand: the omnirl side of its workload (the
recipe it writes) trains through the real CLI on the saved tiny SD3.5 directory with the figures it reads, and
the flow_grpo config file and driver it writes are valid Python. flow_grpo itself is not installed here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("reference_trainer", REPO / "benchmarks" / "reference_trainer.py")
reference_trainer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference_trainer)  # its own module: benchmarks/ stays off sys.path


def test_the_omnirl_side_of_the_workload_trains_and_the_flow_grpo_files_compile(tmp_path: Path):
    from omnirl_plugin_sd35.tiny import save_tiny

    save_tiny(tmp_path / "sd35-tiny")
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "train.txt").write_text("\n".join(reference_trainer.PROMPTS) + "\n")
    recipe = reference_trainer.omnirl_recipe(tmp_path / "sd35-tiny", tmp_path / "prompts", steps=2, threads=2,
                                             cfg_grad="both")
    r = recipe["rollout"]
    assert r["prompts_per_step"] * r["group_size"] == reference_trainer.IMAGES_PER_STEP
    assert recipe["model"]["lora"]["target_modules"] == reference_trainer.LORA_TARGETS
    path = tmp_path / "omnirl.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    omnirl = Path(sys.executable).with_name("omnirl")
    proc = subprocess.run([str(omnirl), "train", "--recipe", str(path), "-o", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["time/step_s"] > 0 and row["time/train_s"] > 0 and row["reward/mean"] < 0 for row in rows)
    compile(reference_trainer.FLOW_GRPO_CONFIG, "flow_grpo_config.py", "exec")
    compile(reference_trainer.DRIVER, "driver.py", "exec")
