"""BAGEL under the fsdp2 train engine (the engine its recipes name): the decoder layers, below
``language_model.model``, are sharded one by one, and ``prompt_kv`` (called outside ``forward``) gathers the
parameters too; one rank trains exactly as the single-process torch engine does."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnirl_core.testing import run_train

ARGS = ["--model", "bagel", "--algo", "flowgrpo", "--preset", "tiny", "--steps", "2"]


@pytest.mark.slow
def test_fsdp2_trains_like_the_torch_engine(tmp_path: Path):
    torch_rows = run_train(tmp_path / "torch", *ARGS)
    fsdp2_rows = run_train(tmp_path / "fsdp2", *ARGS, "--set", "train.engine=fsdp2")
    assert len(torch_rows) == len(fsdp2_rows) == 2
    for a, b in zip(torch_rows, fsdp2_rows):
        for key in ("reward/mean", "loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-8), (a["step"], key)
