"""An algorithm's own state (DiffusionNFT's EMA sampler policy, Diffusion-DPO's online reference snapshot,
FlowGRPO's EMA of the trained weights) is checkpointed with the run: a run stopped and resumed computes what an uninterrupted one does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnirl_core.testing import run_train

CASES = {
    # the EMA lags the trained weights from step 2 on: a restarted EMA would show a different lag
    "nft": ["--algo", "nft", "--set", "algorithm.options.ema_rate=0.3"],
    # a snapshot refreshed every 3 steps: at step 3 a restarted snapshot would be the resumed weights
    "dpo": ["--algo", "dpo", "--set", "algorithm.options.ref_update_every=3"],
    # FlowGRPO's EMA of the trained weights, folded in every other optimizer step (2 per step): evaluated at
    # steps 2 and 4; a restarted EMA or clock would evaluate other weights
    "flowgrpo-ema": ["--algo", "flowgrpo", "--set", "algorithm.options.ema=true", "--set",
                     "algorithm.options.ema_interval=2", "--set", "train.minibatches=2", "--set",
                     "data.prompts=builtin:colors", "--set", "run.eval_every=2", "--set", "run.eval_prompts=2",
                     "--set", "run.eval_samples=1"],
}
COMMON = ["--model", "qwen-image", "--preset", "tiny", "--set", "rollout.prompts_per_step=2",
          "--set", "rollout.group_size=4", "--set", "rollout.num_steps=4", "--set", "run.save_every=1",
          "--set", "run.threads=fixed"]  # the adaptive pool follows the load, and at this batch the count changes the sums


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(CASES))
def test_resumed_run_matches_an_uninterrupted_one(tmp_path: Path, algo: str):
    args = [*COMMON, *CASES[algo]]
    straight = run_train(tmp_path / "straight", *args, "--steps", "4")
    run_train(tmp_path / "resumed", *args, "--steps", "2")
    ckpt = tmp_path / "resumed" / "checkpoints" / "step-000002"
    assert (ckpt / "algorithm.safetensors").is_file() and (ckpt / "algorithm.json").is_file()
    resumed = run_train(tmp_path / "resumed", *args, "--steps", "4")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    keys = [k for k in straight[-1] if k.startswith(("reward/", "loss", "nft/", "dpo/", "kl", "flowgrpo/", "eval/"))]
    assert keys
    for a, b in zip(straight, resumed):
        for key in keys:
            assert (key in a) == (key in b), (a["step"], key)  # eval/ rows: the evaluated steps only
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
    if algo == "nft":
        assert json.loads((ckpt / "algorithm.json").read_text()) == {"updates": 2}
    if algo == "flowgrpo-ema":
        assert json.loads((ckpt / "algorithm.json").read_text()) == {"optimizer_steps": 4}
        assert "eval/reward/mean" in keys and "flowgrpo/ema_lag_rms" in keys
