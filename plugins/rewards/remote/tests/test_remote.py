"""The reward server and the remote reward, over real HTTP on 127.0.0.1: same scores as in process (images,
video, text, records), concurrent requests batched, one bad request failing only itself, bad input, the
bearer token, a server that is down or dies; and end to end, a training run through `omnirl reward serve`
that scores like the in-process reward, whose server is killed mid-run (clear error) and which resumes to
the same numbers."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from omnirl_core.contracts import Reward
from omnirl_core.errors import UsageError
from omnirl_core.loop.distributed import free_port
from omnirl_core.rewards.client import RemoteOptions, RemoteReward, RemoteRewardError
from omnirl_core.rewards.server import TOKEN_ENV, RewardServer
from omnirl_core.rewards.wire import CONTENT_TYPE, EncodedRequest
from omnirl_core.testing.forkserver import run_omnirl


def brightness(outputs, prompts):
    """A reward of the 8-bit picture (like every image reward here): mean level + prompt length."""
    return [float((o.clamp(0, 1) * 255).round().mean()) / 255 + len(p) / 100 if not isinstance(o, str)
            else float(len(o)) for o, p in zip(outputs, prompts)]


class Recording(Reward):
    """Records the batch sizes it was called with; fails on a prompt that says 'fail'. Each sample is scored on
    its own, so the server may merge concurrent requests into one call."""

    uses_inputs = True
    batch_invariant = True

    def __init__(self, delay_s: float = 0.0):
        self.sizes: list[int] = []
        self.delay_s = delay_s

    def __call__(self, outputs, prompts, inputs):
        self.sizes.append(len(prompts))
        time.sleep(self.delay_s)
        if any("fail" in p for p in prompts):
            raise ValueError("asked to fail")
        return [float(x["bonus"]) + o.mean().item() for o, x in zip(outputs, inputs)]


@pytest.fixture
def serve():
    servers = []

    def start(reward, **kwargs):
        server = RewardServer(reward, "test-reward", port=0, **kwargs).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def _images(n: int, h: int = 16, w: int = 12, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, h, w, generator=g) * 1.2 - 0.1 for _ in range(n)]  # some values outside [0, 1]


def test_images_video_and_text_score_as_in_process(serve):
    server = serve(brightness)
    remote = RemoteReward(RemoteOptions(url=server.url, expect="test-reward", batch_size=2))
    video = torch.rand(3, 5, 8, 8, generator=torch.Generator().manual_seed(1))
    outputs = [*_images(3), video, "some text"]
    prompts = ["a", "bb", "ccc", "a video", "x"]
    assert remote(outputs, prompts) == brightness(outputs, prompts)  # exactly: the tensors travel as they are
    assert server.info()["requests"] == 1  # not batch-invariant: the call goes whole, as in process
    assert [x.shape for x in EncodedRequest([video, "t"], ["a", "b"]).tensors] == [video.shape]


def test_replies_leave_at_once_on_a_kept_alive_connection(serve):
    """A reply is two writes, headers and body: with Nagle's algorithm the body waited for the client's delayed
    ACK of the headers, 40 ms on every call of a kept-alive connection. The server's sockets set TCP_NODELAY
    (asyncio's transports do: read here through uvicorn's connection set and each protocol's transport)."""
    import socket

    server = serve(brightness)
    remote = RemoteReward(RemoteOptions(url=server.url))
    for _ in range(2):  # the second call on the connection the first one opened
        remote(_images(1), ["a"])
    assert server.open_connections() == 1, "the client's connection should be kept alive"
    connections = [p.transport.get_extra_info("socket") for p in server.server.server_state.connections]
    assert all(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for c in connections)


def test_concurrent_requests_are_batched_and_records_reach_the_reward(serve):
    reward = Recording(delay_s=0.05)
    server = serve(reward, max_batch=64, max_wait_ms=20)
    remote = RemoteReward(RemoteOptions(url=server.url))
    images = _images(12)

    def one(i: int) -> list[float]:
        return remote([images[i]], [f"p{i}"], inputs=[{"bonus": i}])

    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(one, range(12)))
    assert got == [[i + images[i].mean().item()] for i in range(12)]
    assert sum(reward.sizes) == 12 and len(reward.sizes) < 12 and max(reward.sizes) > 1, reward.sizes
    info = server.info()
    assert info["requests"] == 12 and info["batches"] == len(reward.sizes) and info["largest_batch"] > 1


def test_submit_returns_at_once_and_overlapping_calls_are_batched_by_the_server(serve):
    """What a Ray async reward actor awaits: each call's future, the same scores as a plain call; calls in flight
    together (up to ``concurrency``) reach the server together and share its batches; a failing call fails only
    its own future."""
    import asyncio

    from omnirl_core.contracts import GenRequest, RolloutPlan, Sample
    from omnirl_core.rewards.dispatch import RewardFn, RewardSet

    gate = threading.Event()

    class Gated(Recording):  # scores nothing until the test opens the gate
        def __call__(self, outputs, prompts, inputs):
            gate.wait(60)
            return super().__call__(outputs, prompts, inputs)

    reward = Gated()
    server = serve(reward, max_batch=64, max_wait_ms=100)
    remote = RemoteReward(RemoteOptions(url=server.url, concurrency=4, batch_size=16))
    try:
        assert remote.capacity == 16
        images = _images(6)
        futures = [remote.submit(images[2 * i:2 * i + 2], [f"p{2 * i}", f"p{2 * i + 1}"],
                                 inputs=[{"bonus": 2 * i}, {"bonus": 2 * i + 1}]) for i in range(3)]
        assert not any(f.done() for f in futures)  # each returned while the server still held its call
        gate.set()
        got = [f.result(timeout=30) for f in futures]
        want = [remote(images[2 * i:2 * i + 2], [f"p{2 * i}", f"p{2 * i + 1}"],
                       inputs=[{"bonus": 2 * i}, {"bonus": 2 * i + 1}]) for i in range(3)]
        assert got == want
        assert max(reward.sizes[:-3]) > 2, reward.sizes  # the three submitted calls shared server batches
        failing = remote.submit(images[:1], ["fail"], inputs=[{"bonus": 0}])
        fine = remote.submit(images[:1], ["p"], inputs=[{"bonus": 1}])
        with pytest.raises(RemoteRewardError, match="asked to fail"):
            failing.result(timeout=30)
        assert fine.result(timeout=30) == [1 + images[0].mean().item()]

        rewards = RewardSet([RewardFn("remote", remote)], timeout_s=30)  # the actor's path: awaited on a loop
        assert rewards.submittable and rewards.batch_capacity == 16
        plan = RolloutPlan(step_kinds=("sde",), train_steps=(0,))
        samples = [Sample(request=GenRequest(uid=i, prompt=f"p{i}", prompt_index=i, group=0, seed=i, height=16,
                                             width=12, plan=plan, inputs={"bonus": i}),
                          latents=None, sigmas=None, logprobs=None, output=images[i]) for i in range(3)]
        asyncio.run(rewards.ascore(samples))
        assert [s.reward for s in samples] == [want[0][0], want[0][1], want[1][0]]
    finally:
        remote.close()


def test_a_failing_request_fails_only_itself(serve):
    reward = Recording(delay_s=0.05)
    server = serve(reward, max_wait_ms=50)
    remote = RemoteReward(RemoteOptions(url=server.url))
    image = _images(1)

    def one(prompt: str):
        try:
            return remote(image, [prompt], inputs=[{"bonus": 1}])
        except RemoteRewardError as exc:
            return str(exc)

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, ["ok", "please fail", "ok", "ok"]))
    assert [isinstance(g, list) for g in got] == [True, False, True, True]
    assert "answered 500: reward 'test-reward' failed: ValueError: asked to fail" in got[1]


def test_the_http_servers_own_plain_text_answers_fail_with_what_to_change(serve):
    """uvicorn answers a request on a connection past --max-connections with a plain-text 503 (not the app's
    JSON): after the retries the call fails naming the limit, not with a JSON decode error."""
    import socket

    server = serve(brightness, max_connections=1)
    remote = RemoteReward(RemoteOptions(url=server.url, retries=1, retry_wait_s=0.01))  # its connection: kept
    other = socket.create_connection((server.host, server.port), timeout=60)  # the second: past the cap
    try:
        deadline = time.monotonic() + 60
        while server.open_connections() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RemoteRewardError) as error:
            remote(_images(1), ["a"])
        assert "answered 503 'Service Unavailable': every connection the server serves at once is taken (its " \
               "--max-connections)" in str(error.value)
        other.close()
        deadline = time.monotonic() + 60
        while server.open_connections() > 0 and time.monotonic() < deadline:  # the 503s closed the client's
            time.sleep(0.01)
        assert remote(_images(1), ["a"]) == brightness(_images(1), ["a"])
    finally:
        other.close()
        remote.close()


def test_bad_requests_are_refused_with_a_reason(serve):
    """More cases, with the connection-level ones: tests/test_faults_rewards_server.py."""
    server = serve(brightness)

    def post(body: bytes, kind: str = CONTENT_TYPE) -> httpx.Response:
        return httpx.post(server.url + "/score", content=body, headers={"Content-Type": kind}, timeout=10)

    r = post(b'{"prompts": ["a"], "outputs": [{"kind": "image", "png": "iVBORw0KGgo="}]}', "application/json")
    assert r.status_code == 415 and "must be application/vnd.omnirl.score+safetensors" in r.json()["error"]
    good = EncodedRequest(_images(1), ["a"]).to_bytes()
    r = post(good.replace(b'"omnirl"', b'"other_"'))
    assert r.status_code == 400 and "bad request: the header has no __metadata__['omnirl']" in r.json()["error"]
    r = post(good.replace(b'"dtype": "F32"', b'"dtype": "PKL"'))
    assert r.status_code == 400 and "dtype 'PKL' is not one of" in r.json()["error"]
    assert post(good).json() == {"scores": brightness(_images(1), ["a"])}
    assert httpx.get(server.url + "/nothing", timeout=10).status_code == 404
    shipped = EncodedRequest(_images(1), ["a"], [{"image": "/x.png"}], {"/x.png": b"\x89PNG"}).to_bytes()
    assert post(shipped).status_code == 200  # the reward reads no records: the file is dropped
    from safetensors.torch import save

    meta = {"prompts": ["a"], "outputs": [{"tensor": "outputs.0"}], "inputs": [{"image": "/x.png"}],
            "files": {"/x.png": "outputs.0"}}  # a file naming the output's float tensor
    r = post(save({"outputs.0": _images(1)[0]}, metadata={"omnirl": json.dumps(meta)}))
    assert r.status_code == 400 and "files['/x.png']: expected the name of a 1-D uint8 tensor" in r.json()["error"]


def test_calls_are_not_logged_one_line_each(serve, caplog):
    """httpx logs every request at INFO: some 6,400 lines in a 200-step run, which buried the messages that
    matter. The remote reward's own request lines are dropped; other clients' stay."""
    caplog.set_level(logging.INFO)
    server = serve(brightness)
    remote = RemoteReward(RemoteOptions(url=server.url))
    for _ in range(20):
        remote(_images(1), ["a"])
    lines = [r.getMessage() for r in caplog.records if r.name == "httpx"]
    assert lines == []
    other = serve(brightness)
    httpx.get(other.url + "/health", timeout=10)
    assert [r.getMessage() for r in caplog.records if r.name == "httpx"] == [
        f'HTTP Request: GET {other.url}/health "HTTP/1.1 200 OK"']


def test_bad_scores_from_the_served_reward_are_errors(serve):
    server = serve(lambda outputs, prompts: ["high"] * len(prompts))
    remote = RemoteReward(RemoteOptions(url=server.url))
    with pytest.raises(RemoteRewardError, match="answered 500: .*a score must be a real number"):
        remote(_images(1), ["a"])


def test_bearer_token(serve, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "s3cret-token")
    server = serve(brightness)
    assert RemoteReward(RemoteOptions(url=server.url))(_images(1), ["a"]) == brightness(_images(1), ["a"])
    assert httpx.get(server.url + "/health", timeout=10).status_code == 401
    monkeypatch.setenv(TOKEN_ENV, "wrong")
    with pytest.raises(UsageError) as err:
        RemoteReward(RemoteOptions(url=server.url))
    assert "answered 401: missing or wrong bearer token" in err.value.render()
    assert "s3cret" not in err.value.render() and "wrong" not in err.value.render().replace("wrong bearer", "")


def test_no_server_at_start_and_a_server_that_dies():
    port = free_port()
    with pytest.raises(UsageError) as err:
        RemoteReward(RemoteOptions(url=f"http://user:pw@127.0.0.1:{port}"))
    text = err.value.render()
    assert f"no reward server answers at http://***@127.0.0.1:{port}" in text and "pw" not in text
    assert "omnirl reward serve NAME --port P" in text
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        RemoteOptions(url="127.0.0.1:8700")

    server = RewardServer(brightness, "test-reward", port=0).start()
    remote = RemoteReward(RemoteOptions(url=server.url, retries=2, retry_wait_s=0.05))
    assert remote(_images(1), ["a"]) == brightness(_images(1), ["a"])
    server.close()
    start = time.monotonic()
    with pytest.raises(RemoteRewardError) as err:
        remote(_images(1), ["a"])
    assert time.monotonic() - start < 5
    assert "is unreachable after 3 attempt(s)" in str(err.value)
    assert "omnirl reward serve test-reward --port P" in str(err.value) and "resumes" in str(err.value)


# -- end to end: `omnirl reward serve` + `omnirl train --reward remote` -----------------------------------

def _start_server(port: int, log: Path) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("omnirl")
    handle = log.open("w")
    proc = subprocess.Popen([str(exe), "reward", "serve", "jpeg", "--port", str(port)], stderr=handle,
                            stdout=handle)
    deadline = time.monotonic() + 120
    while "serving reward 'jpeg'" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return proc


def _train(run_dir: Path, prompts: Path, *args: str) -> subprocess.CompletedProcess:
    return run_omnirl(["train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny",
                       "--steps", "5", "-o", str(run_dir), "--set", f"data.prompts={prompts}",
                       "--set", "run.save_every=1", *args], timeout=900, env=dict(os.environ))


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_a_run_through_the_server_scores_like_in_process_and_resumes_after_the_server_dies(tmp_path: Path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\na red house\na green field\n")
    local = _train(tmp_path / "local", prompts, "--reward", "jpeg")
    assert local.returncode == 0, local.stderr[-3000:]

    port, log = free_port(), tmp_path / "server.log"
    remote_args = ("--reward", "remote", "--set", f"rewards.0.options.url=http://127.0.0.1:{port}",
                   "--set", "rewards.0.options.expect=jpeg", "--set", "rewards.0.options.retries=1",
                   "--set", "rewards.0.options.retry_wait_s=0.2")
    server = _start_server(port, log)
    run_dir = tmp_path / "remote"

    def kill_after_two_steps() -> None:
        while len(_rows(run_dir)) < 2 and server.poll() is None:
            time.sleep(0.02)
        server.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=kill_after_two_steps)
    killer.start()
    first = _train(run_dir, prompts, *remote_args)
    killer.join()
    server.wait()
    assert first.returncode == 1, first.stderr[-3000:]
    assert "Required reward 'remote' failed" in first.stderr
    assert f"reward server http://127.0.0.1:{port} is unreachable" in first.stderr
    assert "rerun the same train command: the run resumes" in first.stderr
    done = len(_rows(run_dir))
    assert 2 <= done < 5

    server = _start_server(port, log)
    try:
        second = _train(run_dir, prompts, *remote_args)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    assert second.returncode == 0, second.stderr[-3000:]
    keys = ("step", "reward/mean", "reward/std", "loss")
    got = [[row[k] for k in keys] for row in _rows(run_dir)]
    assert got == [[row[k] for k in keys] for row in _rows(tmp_path / "local")]  # same seeds, same numbers
