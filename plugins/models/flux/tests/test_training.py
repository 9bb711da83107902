"""Every flow algorithm trains FLUX.1's tiny preset through the real CLI, and the colour reward rises.

One parametrised test, short runs: one prompt x 8 samples for STEPS steps (one prompt: the step-to-step
spread of the mean reward is then sampling noise only, not which colours were drawn), so that the few LoRA
updates at the tiny preset's lr 1e-2 show: the mean of the last WINDOW steps beats the first WINDOW's. Runs are
seeded, so the outcome does not depend on the machine's load."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from omnirl_core.testing import installed_algorithms, run_train

ALGORITHMS = ("flowgrpo", "mixgrpo", "dancegrpo", "grpo-guard", "dpo", "nft")
STEPS, WINDOW = 12, 4


def _installed_algorithms() -> set[str]:
    return installed_algorithms()


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_every_flow_algorithm_trains_the_tiny_preset_and_the_reward_rises(tmp_path: Path, algo: str):
    if algo not in _installed_algorithms():
        pytest.skip(f"algorithm plugin '{algo}' is not installed")
    records = run_train(tmp_path / "run", "--model", "flux.1", "--algo", algo, "--preset", "tiny",
                        "--steps", str(STEPS), "--set", "rollout.prompts_per_step=1", "--set", 'data.prompts=["a red square"]',
                        "--set", f"run.save_every={STEPS}", "--set", f"run.sample_every={STEPS}")
    rewards = [r["reward/mean"] for r in records]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    first, last = statistics.fmean(rewards[:WINDOW]), statistics.fmean(rewards[-WINDOW:])
    assert last > first, (algo, rewards)
    assert (tmp_path / "run" / "checkpoints" / f"step-{STEPS:06d}" / "pytorch_lora_weights.safetensors").is_file()
