"""The reward server (``omnirl reward serve``) against clients that misbehave, over real sockets on 127.0.0.1:
every request it cannot use gets a 4xx with a reason (never a traceback or a read to the end of the stream):
a JSON ``error`` from the app for what it decides, uvicorn's plain-text 400 for HTTP it cannot parse; idle
kept-alive connections are closed, connections past the cap are answered 503, the bodies held at once stay
within the limit, and a large body costs about its own size, released after the call.

The bodies are written by hand here (the safetensors layout: an 8-byte little-endian header length, the JSON
header, the tensors' bytes), so that the checks do not depend on the client's encoder."""

from __future__ import annotations

import http.client
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from omnirl_core.rewards.server import RewardServer

TYPE = "application/vnd.omnirl.score+safetensors"
DEEP = 100_000
WAIT_S = 60  # generous: the checks count and gate, they never time the server


def body(meta: dict | str, tensors: dict[str, dict] | None = None, data: bytes = b"", header: str | None = None) -> bytes:
    """A /score body: ``tensors`` maps names to safetensors entries; ``header`` replaces the whole header."""
    if header is None:
        text = meta if isinstance(meta, str) else json.dumps(meta)
        header = json.dumps({"__metadata__": {"omnirl": text}, **(tensors or {})})
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def request(path: str = "/score", length: int | str | None = None, kind: str = TYPE, method: str = "POST",
            extra: str = "") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if kind:
        lines.append(f"Content-Type: {kind}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def exchange(server: RewardServer, head: bytes, payload: bytes = b"", half_close: bool = False,
             closes: bool = False):
    """Send; return (status, decoded JSON body or raw bytes, with ``closes``: whether the server closed the
    connection after its answer, else None); (None, None, True) when the server closed it without an answer."""
    sock = socket.create_connection((server.host, server.port), timeout=WAIT_S)
    try:
        try:
            sock.sendall(head + payload)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server answered and closed before the whole body was sent
            pass
        response = http.client.HTTPResponse(sock)
        try:
            response.begin()
        except http.client.RemoteDisconnected:
            return None, None, True
        raw = response.read()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = raw
        closed = None
        if closes:
            try:
                closed = sock.recv(1) == b""
            except TimeoutError:
                closed = False
            except OSError:  # reset: closed too
                closed = True
        return response.status, answer, closed
    finally:
        sock.close()


def scores_of_sizes(outputs, prompts):
    return [float(o.numel()) if hasattr(o, "numel") else float(len(o)) for o in outputs]


@pytest.fixture
def serve():
    servers: list[RewardServer] = []

    def start(reward=scores_of_sizes, **options) -> RewardServer:
        servers.append(RewardServer(reward, "sizes", port=0, **options).start())
        return servers[-1]

    yield start
    for server in servers:
        server.close()


F32 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
GOOD = body({"prompts": ["a"], "outputs": [{"tensor": "outputs.0"}]}, {"outputs.0": F32}, bytes(16))
LIMIT = 1 << 20
PARSER = b"Invalid HTTP request received."  # uvicorn's plain-text 400: HTTP it cannot parse, before the app

MALFORMED = {
    # the cases answered before the body is read send their head only: the answer must come without the body
    # (uvicorn closes a connection at once after such an answer; bytes the client sent on past it make the
    # close a reset, which can overtake the answer on the client's side)
    "a negative length": (request(length=-1), b"", False, 400, PARSER),
    "a length that is not a number": (request(length="12abc"), b"x" * 12, False, 400, PARSER),
    "two lengths": (request(length=16, extra="Content-Length: 99999\r\n"), GOOD, False, 400, PARSER),
    "no length": (request(), b"", False, 411, "Content-Length header is required"),
    "a chunked body": (request(extra="Transfer-Encoding: chunked\r\n"), b"10\r\n" + bytes(16) + b"\r\n0\r\n\r\n",
                       False, 411, "chunked bodies"),
    "a length over the limit": (request(length=LIMIT + 1), b"", False, 413, f"over the {LIMIT} byte limit"),
    "a 100k-deep JSON body": (request(length=2 * DEEP, kind="application/json"), b"", False, 415,
                              "must be application/vnd.omnirl.score+safetensors"),
    "a 100k-deep header": (None, body({}, header="[" * DEEP + "]" * DEEP), False, 400, "header is nested too deeply"),
    "100k-deep records": (None, body('{"prompts": ["a"], "outputs": [{"text": "t"}], "inputs": [' + "[" * DEEP
                                     + "]" * DEEP + "]}"), False, 400, "is nested too deeply"),
    "a header longer than the body": (None, struct.pack("<Q", 1 << 40) + b"{}", False, 400, "header length"),
    "a header that is not JSON": (None, body({}, header="{not json"), False, 400, "header is not valid JSON"),
    "tensor bytes that do not fit its shape": (None, body({"prompts": ["a"], "outputs": [{"tensor": "t"}]}, {
        "t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, bytes(16)), False, 400, "takes 12 bytes"),
    "an unknown dtype": (None, body({"prompts": ["a"], "outputs": [{"tensor": "t"}]}, {
        "t": {"dtype": "PICKLE", "shape": [16], "data_offsets": [0, 16]}}, bytes(16)), False, 400, "dtype 'PICKLE'"),
    "an output naming no tensor": (None, body({"prompts": ["a"], "outputs": [{"tensor": "nope"}]}), False, 400,
                                   "outputs[0]: expected {'tensor': NAME}"),
    "fewer outputs than prompts": (None, body({"prompts": ["a", "b"], "outputs": [{"text": "t"}]}), False, 400,
                                   "as long as 'prompts'"),
    # the client's end of the stream (half-close) ends the connection under uvicorn: nothing to answer
    "a body shorter than its length": (request(length=len(GOOD)), GOOD[:-8], True, None, None),
    "PUT": (request(method="PUT", length=0), b"", False, 405, "PUT is not served"),
    "an unknown path": (request(path="/pickle", length=len(GOOD)), GOOD, False, 404, "no such endpoint"),
    "a header line over 64 KiB": (b"GET /health HTTP/1.1\r\nX-Pad: " + b"a" * 70_000 + b"\r\n\r\n", b"", False, 400,
                                  PARSER),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_every_malformed_request_gets_a_4xx_with_a_reason_and_the_server_goes_on(serve, case):
    """Before the first checks: Content-Length -1 read the stream to its end (a 300 MiB stream grew the server to
    2.7 GB; here it never answered), a 100k-deep JSON body ended in a RecursionError traceback and a dropped
    connection, and a chunked body got a 411 whose unread body was then parsed as the next request. A str
    ``message`` is the app's JSON error, bytes uvicorn's plain-text answer."""
    server = serve(max_body_bytes=LIMIT)
    head, payload, half_close, status, message = MALFORMED[case]
    if head is None:
        head = request(length=len(payload))
    got, answer, closed = exchange(server, head, payload, half_close, closes=bool(payload) or status in (413, 415))
    assert got == status, (got, answer)
    if isinstance(message, bytes):
        assert answer == message, answer
    elif message is not None:
        assert isinstance(answer, dict) and message in answer["error"], answer
    assert closed in (None, True)  # a body the server did not read (all of) must not be taken for the next request
    assert exchange(server, request(length=len(GOOD)), GOOD)[:2] == (200, {"scores": [4.0]})


def test_idle_connections_are_closed_and_a_stalled_body_gets_408(serve):
    """Before the first checks: connections had no timeout (200 slow connections held 203 threads). uvicorn
    times out a kept-alive connection after an answer (a connection that never sends a request is held until
    its client closes it: docs/REWARDS.md)."""
    server = serve(idle_timeout_s=1.0)
    idle = [socket.create_connection((server.host, server.port), timeout=WAIT_S) for _ in range(20)]
    try:
        for sock in idle:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            response = http.client.HTTPResponse(sock)
            response.begin()
            assert response.status == 200 and json.loads(response.read())["reward"] == "sizes"
        for sock in idle:
            assert sock.recv(1) == b""  # closed by the server, not by us
        deadline = time.monotonic() + WAIT_S
        while server.open_connections() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.open_connections()
    finally:
        for sock in idle:
            sock.close()
    status, answer, closed = exchange(server, request(length=len(GOOD)), GOOD[:20], closes=True)  # then nothing
    assert status == 408 and "nothing arrived for 1 s" in answer["error"] and closed


def test_connections_past_the_cap_are_answered_503_at_once(serve):
    """uvicorn's own plain-text 503 (limit_concurrency), the connection closed; the remote reward retries it."""
    server = serve(max_connections=4, idle_timeout_s=WAIT_S * 10)
    held = [socket.create_connection((server.host, server.port), timeout=WAIT_S) for _ in range(4)]
    try:
        deadline = time.monotonic() + WAIT_S
        while server.open_connections() < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert exchange(server, request(length=len(GOOD)), GOOD, closes=True) == (503, b"Service Unavailable", True)
        held.pop().close()
        deadline = time.monotonic() + WAIT_S
        while server.open_connections() > 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert exchange(server, request(length=len(GOOD)), GOOD)[:2] == (200, {"scores": [4.0]})
    finally:
        for sock in held:
            sock.close()


def test_the_bodies_held_at_once_stay_within_the_limit(serve):
    """Two requests of 0.6 MiB under a 1 MiB limit: the second is read only once the first is answered."""
    gate, called = threading.Event(), threading.Event()

    def gated(outputs, prompts):
        called.set()
        gate.wait(WAIT_S)
        return scores_of_sizes(outputs, prompts)

    server = serve(gated, max_body_bytes=LIMIT)
    size = 600 * 1024 // 4
    big = body({"prompts": ["a"], "outputs": [{"tensor": "t"}]},
               {"t": {"dtype": "F32", "shape": [size], "data_offsets": [0, 4 * size]}}, bytes(4 * size))
    results: list = []
    first = threading.Thread(target=lambda: results.append(exchange(server, request(length=len(big)), big)))
    first.start()
    assert called.wait(WAIT_S)
    second = threading.Thread(target=lambda: results.append(exchange(server, request(length=len(big)), big)))
    second.start()
    deadline = time.monotonic() + WAIT_S
    while server.open_connections() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    second.join(0.5)  # the second request has arrived; it must still be waiting
    assert server.budget.held == len(big) and not results
    gate.set()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert [r[:2] for r in results] == [(200, {"scores": [float(size)]})] * 2
    assert server.budget.held == 0


SERVE = """
import sys
from omnirl_core.rewards.server import RewardServer
server = RewardServer(lambda outputs, prompts: [float(o.numel()) for o in outputs], "sizes", port=0)
print(server.port, flush=True)
server.serve_forever()
"""


def _memory_mib(pid: int) -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_a_large_body_costs_about_its_size_and_is_released(tmp_path):
    """A 200 MB tensor: the server's peak grows by about 200 MB (the tensor, read in place), and falls back
    once it is answered. Before: a 200 MB body within the limit cost 1 GB that was never released."""
    proc = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())

        def post(numel: int) -> tuple[int, dict]:
            head = body({"prompts": ["a"], "outputs": [{"tensor": "t"}]},
                        {"t": {"dtype": "F32", "shape": [numel], "data_offsets": [0, 4 * numel]}})
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S * 5)
            connection.putrequest("POST", "/score")
            connection.putheader("Content-Type", TYPE)
            connection.putheader("Content-Length", str(len(head) + 4 * numel))
            connection.endheaders(head)
            chunk = bytes(1 << 20)
            left = 4 * numel
            while left:
                connection.send(chunk[:min(left, len(chunk))])
                left -= min(left, len(chunk))
            response = connection.getresponse()
            answer = response.status, json.loads(response.read())
            connection.close()
            return answer

        assert post(1000) == (200, {"scores": [1000.0]})  # torch imported, the threads started
        before = _memory_mib(proc.pid)["VmRSS"]
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # reset the peak
        numel = 50_000_000  # 200 MB
        assert post(numel) == (200, {"scores": [float(numel)]})
        time.sleep(0.5)
        after = _memory_mib(proc.pid)
        body_mib = 4 * numel / 2**20
        assert after["VmHWM"] - before < 1.2 * body_mib + 32, (before, after)
        assert after["VmRSS"] - before < 32, (before, after)  # released
    finally:
        proc.terminate()
        proc.wait(30)
