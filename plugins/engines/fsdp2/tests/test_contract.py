"""The core's train-engine contract suite (``omnirl_core.testing.engines.check_train_engine``) on FSDP2: one rank
in this process (the engine forms its own gloo group) and two ranks as processes. Checkpoints are sharded, so the
suite's save -> load into a fresh engine -> same second update also covers the shards."""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from omnirl_plugin_fsdp2.engine import FSDP2TrainEngine

from omnirl_core.loop.distributed import free_port
from omnirl_core.testing.engines import check_train_engine
from omnirl_core.testing.forkserver import run_script

JOB = Path(__file__).with_name("contract_job.py")


def test_train_engine_contract_on_one_rank(tmp_path: Path):
    owned = not dist.is_initialized()
    try:
        metrics = check_train_engine(lambda model, train: FSDP2TrainEngine(model, train, None, "cpu"),
                                     directory=tmp_path)
    finally:
        if owned and dist.is_initialized():  # the group this test's engines formed
            dist.destroy_process_group()
    assert (tmp_path / "shards" / "rank-00000-of-00001.safetensors").is_file()
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file()
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_train_engine_contract_on_two_ranks(tmp_path: Path):
    port = str(free_port())

    def rank(index: int) -> subprocess.CompletedProcess:
        env = {**os.environ, "RANK": str(index), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        return run_script(JOB, [str(tmp_path)], env=env, timeout=600)

    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(rank, range(2)))
    for proc in procs:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    # both ranks computed the same (all-reduced) loss, and each wrote its shard
    assert procs[0].stdout.split("loss ")[-1] == procs[1].stdout.split("loss ")[-1]
    assert {p.name for p in (tmp_path / "shards").glob("*.safetensors")} == \
        {"rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"}
