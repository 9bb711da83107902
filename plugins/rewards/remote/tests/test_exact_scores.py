"""A served reward gives exactly the in-process scores, bit for bit, through a real server on 127.0.0.1: the
outputs travel as their own tensors (dtype, shape, bits), the scores as JSON numbers that read back as the
same doubles, and the server calls the reward with the batch of each call (it merges concurrent calls only for
a batch-invariant reward). Before: images went as 8-bit PNG, so the colour reward (which reads the float
image) scored up to ~1e-6 off, and concurrent calls were merged into one call of a batch-dependent reward.
End to end: a training run through ``omnirl reward serve color`` has the in-process run's rewards and losses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from omnirl_core.contracts import Reward
from omnirl_core.loop.distributed import free_port
from omnirl_core.rewards.client import RemoteOptions, RemoteReward, RemoteRewardError
from omnirl_core.rewards.server import RewardServer
from omnirl_core.rewards_kit import build_reward
from omnirl_core.testing.forkserver import run_omnirl


def bits(scores: list[float]) -> list[bytes]:
    return [struct.pack("<d", s) for s in scores]


@pytest.fixture
def serve():
    servers: list[RewardServer] = []

    def start(reward, name: str, **options) -> RewardServer:
        servers.append(RewardServer(reward, name, port=0, **options).start())
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_the_served_colour_reward_scores_bit_for_bit_as_in_process(serve):
    g = torch.Generator().manual_seed(0)
    outputs = [torch.rand(3, 32, 32, generator=g) for _ in range(6)]
    outputs += [torch.rand(3, 4, 16, 16, generator=g),  # a video
                torch.rand(3, 32, 32, generator=g).to(torch.bfloat16),  # another dtype
                torch.rand(3, 40, 24, generator=g)[:, 4:36, :].clone() * 1.2 - 0.1]  # values outside [0, 1]
    prompts = ["a red square", "a green car", "a blue sky", "a yellow cab", "a purple cow", "a gray wall",
               "a white video", "an orange", "a black cat"]
    color = build_reward("color")[0]  # the installed colour reward, by name
    server = serve(color, "color")
    remote = RemoteReward(RemoteOptions(url=server.url, expect="color", batch_size=4))
    try:
        got = remote(outputs, prompts)
        assert bits(got) == bits(color(outputs, prompts))
        assert remote.batch_invariant and server.info()["requests"] == 3  # batch_size 4: nine samples, 3 requests
    finally:
        remote.close()


class WithinBatch:
    """A reward whose scores depend on what shares its call (like a learned reward's batched forward, or one
    that normalises within its call): each image's mean minus the call's mean."""

    def __init__(self, gate: threading.Event | None = None):
        self.gate = gate
        self.sizes: list[int] = []

    def __call__(self, outputs, prompts):
        if self.gate is not None:
            self.gate.wait(60)
        self.sizes.append(len(prompts))
        means = torch.stack([o.double().mean() for o in outputs])
        return (means - means.mean()).tolist()


def test_concurrent_calls_of_a_batch_dependent_reward_are_scored_as_in_process(serve):
    """Three calls in flight together: the server scores each call's own batch, as the run would in process.
    Before, it merged them into one call of six, so every score moved."""
    gate = threading.Event()
    reward = WithinBatch(gate)
    server = serve(reward, "within-batch", max_wait_ms=2000)  # before: the three calls were merged
    remote = RemoteReward(RemoteOptions(url=server.url, concurrency=3))
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 8, 8, generator=g) for _ in range(6)]
    prompts = [f"p{i}" for i in range(6)]
    try:
        assert not getattr(remote, "batch_invariant", False)
        futures = [remote.submit(images[i:i + 2], prompts[i:i + 2]) for i in (0, 2, 4)]
        deadline = time.monotonic() + 60
        while server.open_connections() < 3 and time.monotonic() < deadline:  # all three calls have reached it
            time.sleep(0.01)
        gate.set()
        got = [f.result(timeout=60) for f in futures]
        want = [WithinBatch()(images[i:i + 2], prompts[i:i + 2]) for i in (0, 2, 4)]
        assert [bits(s) for s in got] == [bits(s) for s in want]
        assert reward.sizes == [2, 2, 2]
    finally:
        remote.close()


# -- an edit's source and mask travel with the request ------------------------------------------------------

class WithoutTheRunsDisk(Reward):
    """A test double for the boundary this machine cannot show, a reward server on another machine: it wraps the
    real reward and deletes the run's data directory before each call, so the reward can read only the files
    that came with the request. Records the source paths it was handed."""

    uses_inputs = True

    def __init__(self, reward: Reward, data_dir: Path):
        self.reward, self.data_dir, self.seen = reward, data_dir, []
        self.batch_invariant = reward.batch_invariant

    def __call__(self, outputs, prompts, inputs=None):
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.seen += [r["image"] for r in inputs]
        return self.reward(outputs, prompts, inputs=inputs)


def _edits(data_dir: Path) -> list[dict]:
    """Two sources (one shared by two samples) and their masks, as PNG files in data_dir."""
    from PIL import Image

    data_dir.mkdir(exist_ok=True)
    g = torch.Generator().manual_seed(3)
    records = []
    for i in range(2):
        source, mask = data_dir / f"source-{i}.png", data_dir / f"mask-{i}.png"
        pixels = (torch.rand(24, 20, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(source)
        region = torch.zeros(24, 20, dtype=torch.uint8)
        region[4:14, 3:12] = 255
        Image.fromarray(region.numpy()).save(mask)
        records.append({"image": str(source), "mask": str(mask), "id": i})
    return [records[0], records[0], records[1]]


@pytest.mark.parametrize("name", ["edit-consistency", "edit-color"])
def test_an_edits_source_and_mask_reach_a_server_without_the_runs_disk(serve, tmp_path: Path, name: str):
    data = tmp_path / "data"
    records = _edits(data)
    g = torch.Generator().manual_seed(4)
    outputs = [torch.rand(3, 32, 32, generator=g) for _ in records]
    prompts = ["make the square red", "make the square red", "make the circle blue"]
    reward = build_reward(name)[0]
    want = reward(outputs, prompts, inputs=records)
    served = WithoutTheRunsDisk(reward, data)
    server = serve(served, name)
    remote = RemoteReward(RemoteOptions(url=server.url, expect=name))
    try:
        assert bits(remote(outputs, prompts, inputs=records)) == bits(want)
        assert not data.exists()
        # the server's copies: one per file, outside the run's directory, removed once the request was scored
        assert len(set(served.seen)) == 2 and not any(Path(p).exists() or str(data) in p for p in served.seen)
        _edits(data)
        off = RemoteReward(RemoteOptions(url=server.url, send_files=False))
        with pytest.raises(RemoteRewardError, match="failed"):  # the paths alone: the server cannot open them
            off(outputs, prompts, inputs=records)
        off.close()
    finally:
        remote.close()


# -- end to end: `omnirl reward serve color` + `omnirl train --reward remote` ------------------------------

def _train(run_dir: Path, prompts: Path, *args: str) -> subprocess.CompletedProcess:
    return run_omnirl(["train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny",
                       "--steps", "3", "-o", str(run_dir), "--set", f"data.prompts={prompts}", *args],
                      timeout=900, env=dict(os.environ))


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_run_through_the_served_colour_reward_trains_as_in_process(tmp_path: Path):
    """Before: `reward/mean` differed by 1e-6 to 3e-6 per step and the weights diverged."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red house\na green field\na blue car\na yellow flower\n")
    local = _train(tmp_path / "local", prompts, "--reward", "color")
    assert local.returncode == 0, local.stderr[-3000:]

    port, log = free_port(), tmp_path / "server.log"
    with log.open("w") as handle:
        server = subprocess.Popen([str(Path(sys.executable).with_name("omnirl")), "reward", "serve", "color",
                                   "--port", str(port)], stdout=handle, stderr=handle)
    try:
        deadline = time.monotonic() + 120
        while "serving reward 'color'" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        remote = _train(tmp_path / "remote", prompts, "--reward", "remote", "--set",
                        f"rewards.0.options.url=http://127.0.0.1:{port}", "--set", "rewards.0.options.expect=color")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    assert remote.returncode == 0, remote.stderr[-3000:]
    keys = ("step", "reward/mean", "reward/std", "loss", "kl")
    got = [[row.get(k) for k in keys] for row in _rows(tmp_path / "remote")]
    assert got == [[row.get(k) for k in keys] for row in _rows(tmp_path / "local")]
    assert len(got) == 3
