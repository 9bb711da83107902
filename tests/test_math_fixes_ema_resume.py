"""FlowGRPO's EMA stepped per micro-batch (``ema_step: microbatch``, issue 30) through the real CLI: a run stopped
after step 2 and resumed computes what an uninterrupted one does, and the EMA differs from ``ema_step: update``'s
(the option reaches the run). As tests/test_algorithm_state.py does for the default ``update``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnirl_core.testing import run_train

# 8 samples, 3 trained steps, 2 minibatches of 4 samples; micro-batches of 3 transitions: 4 per minibatch, so
# flow_grpo's count with its batch = 3 samples, ceil(4 / 3) = 2 EMA steps per optimizer step; folded every step
ARGS = ["--model", "qwen-image", "--preset", "tiny", "--algo", "flowgrpo", "--set", "rollout.prompts_per_step=2",
        "--set", "rollout.group_size=4", "--set", "rollout.num_steps=4", "--set", "train.minibatches=2",
        "--set", "train.micro_batch_size=3", "--set", "algorithm.options.ema=true",
        "--set", "algorithm.options.ema_interval=1", "--set", "data.prompts=builtin:colors",
        "--set", "run.eval_every=2", "--set", "run.eval_prompts=2", "--set", "run.eval_samples=1",
        "--set", "run.save_every=1", "--set", "run.threads=fixed"]
MICROBATCH = ["--set", "algorithm.options.ema_step=microbatch"]
KEYS = ("reward/mean", "loss", "kl", "flowgrpo/ema_lag_rms", "eval/reward/mean")


@pytest.mark.slow
def test_microbatch_ema_resumes_exactly(tmp_path: Path):
    straight = run_train(tmp_path / "straight", *ARGS, *MICROBATCH, "--steps", "4")
    run_train(tmp_path / "resumed", *ARGS, *MICROBATCH, "--steps", "2")
    ckpt = tmp_path / "resumed" / "checkpoints" / "step-000002"
    assert json.loads((ckpt / "algorithm.json").read_text()) == {"optimizer_steps": 4}
    resumed = run_train(tmp_path / "resumed", *ARGS, *MICROBATCH, "--steps", "4")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed):
        for key in KEYS:
            assert (key in a) == (key in b), (a["step"], key)
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
    # the same run with one EMA step per optimizer step: the same training, an EMA further from the weights
    once = run_train(tmp_path / "update", *ARGS, "--steps", "4")
    assert [r["loss"] for r in once] == pytest.approx([r["loss"] for r in straight], rel=1e-5, abs=1e-7)
    assert straight[0]["flowgrpo/ema_lag_rms"] == once[0]["flowgrpo/ema_lag_rms"] == 0.0
    for a, b in zip(straight[1:], once[1:]):
        assert a["flowgrpo/ema_lag_rms"] < b["flowgrpo/ema_lag_rms"], a["step"]
