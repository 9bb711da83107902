"""The real ``omnirl train`` CLI on BAGEL's tiny preset.

CI runs FlowGRPO for two steps. The runs of every flow algorithm and the 40-step FlowGRPO reward rise (the preset's
colour reward on the central half, one prompt: +9.1 standard errors, first 10 vs last 10 steps) take minutes on two
CPU cores (the rise: about 110 s of CPU, 5-7 minutes wall under the shared load): they are not for CI and run with
``OMNIRL_BAGEL_LONG=1`` (figures in the README). Runs are seeded: the outcome does not depend on the load."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omnirl_core.testing import installed_algorithms, reward_rise, run_train

LONG = pytest.mark.skipif(not os.environ.get("OMNIRL_BAGEL_LONG"),
                          reason="not for CI (minutes on 2 CPU cores): set OMNIRL_BAGEL_LONG=1")
FLOW_ALGORITHMS = ("flowgrpo", "mixgrpo", "dancegrpo", "grpo-guard", "dpo", "nft")


def _installed_algorithms() -> set[str]:
    return installed_algorithms()


def _train(run: Path, algo: str, steps: int, *extra: str) -> list[dict]:
    if algo not in _installed_algorithms():
        pytest.skip(f"algorithm plugin '{algo}' is not installed")
    return run_train(run, "--model", "bagel", "--algo", algo, "--preset", "tiny", "--steps", str(steps), *extra)


def test_cli_trains_the_tiny_preset_with_flowgrpo_and_cfg(tmp_path: Path):
    run = tmp_path / "run"
    records = _train(run, "flowgrpo", 2, "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
                     "--set", "rollout.guidance_scale=4.0")
    assert [r["step"] for r in records] == [1, 2]
    assert 0.0 < records[0]["reward/color"] < 1.0
    assert records[0]["logprob/abs_delta_max"] <= 1e-5  # the rollout engine's log-probs vs the trainer's, CFG on
    assert (run / "samples" / "step-000002.png").is_file()
    assert (run / "checkpoints" / "step-000002" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@LONG
@pytest.mark.parametrize("algo", FLOW_ALGORITHMS)
def test_cli_trains_every_flow_algorithm(tmp_path: Path, algo: str):
    records = _train(tmp_path / "run", algo, 3, "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0.0 < r["reward/mean"] < 1.0 for r in records)


@pytest.mark.slow
@LONG
def test_flowgrpo_raises_the_reward(tmp_path: Path):
    run = tmp_path / "run"
    _train(run, "flowgrpo", 40, "--set", "run.sample_every=1000", "--set", "run.save_every=1000")
    first, last, se = reward_rise(run)
    assert last - first >= 2 * se, (first, last, se)
