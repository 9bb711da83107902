"""A negative reward weight trains the model to lower that reward: it is accepted (a penalty can be meant),
with a warning, as a weight of 0 is. Before: accepted without a word."""

from __future__ import annotations

from .conftest import run_cli

BASE = ["train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny", "--dry-run"]


def test_a_negative_reward_weight_is_warned_about():
    proc = run_cli(*BASE, "--reward", "color", "--reward", "jpeg:-0.5")
    assert proc.returncode == 0, proc.stderr
    assert ("reward 'jpeg' has a negative weight (-0.5): the model is trained to lower it (minimised); give a "
            "positive weight to raise it") in proc.stderr
    assert "reward 'color' has" not in proc.stderr  # a positive weight says nothing
