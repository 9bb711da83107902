"""``omnirl reward serve NAME``: any installed reward over HTTP (wire format: ``omnirl_core.rewards.wire``).

A reward model with conflicting dependencies or its own GPU then runs in its own environment, and a run
reaches it with the ``remote`` reward. Requests that arrive together are scored in one call: a batcher thread
takes every waiting request (up to ``max_batch`` samples, waiting at most ``max_wait_ms`` for more after the
first) and calls the reward once; when that batch fails, each request is scored alone, so a bad request fails
only itself. The reward is never called from two threads at once.

With ``OMNIRL_REWARD_SERVER_TOKEN`` in the server's environment, every request must carry
``Authorization: Bearer <token>`` (the remote reward sends it from the same variable); the token is never
printed.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from omnirl_core.rewards.dispatch import check_scores
from omnirl_core.rewards.wire import WireError, decode_request

log = logging.getLogger("omnirl.reward_server")
TOKEN_ENV = "OMNIRL_REWARD_SERVER_TOKEN"
MAX_BODY = 512 * 1024 * 1024


@dataclass
class _Job:
    outputs: list[Any]
    prompts: list[str]
    inputs: list[Any] | None
    future: Future = field(default_factory=Future)


class Batcher:
    """Merges concurrent requests into batched reward calls on one thread."""

    def __init__(self, reward: Callable[..., Any], max_batch: int = 32, max_wait_ms: float = 5.0):
        self.reward = reward
        self.uses_inputs = bool(getattr(reward, "uses_inputs", False))
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        self.stats = {"requests": 0, "samples": 0, "batches": 0, "largest_batch": 0, "failed_batches": 0}
        self._thread = threading.Thread(target=self._loop, daemon=True, name="omnirl-reward-batcher")
        self._thread.start()

    def submit(self, outputs: list[Any], prompts: list[str], inputs: list[Any] | None) -> Future:
        if self.closed:
            raise RuntimeError("the reward server is stopping")
        job = _Job(outputs, prompts, inputs)
        self.jobs.put(job)
        return job.future

    def close(self) -> None:
        self.closed = True
        self.jobs.put(None)
        self._thread.join(5)

    def _call(self, jobs: list[_Job]) -> list[float]:
        outputs = [o for j in jobs for o in j.outputs]
        prompts = [p for j in jobs for p in j.prompts]
        if self.uses_inputs:
            inputs = [x for j in jobs for x in (j.inputs or [None] * len(j.prompts))]
            values = self.reward(outputs, prompts, inputs=inputs)
        else:
            values = self.reward(outputs, prompts)
        return check_scores(values, len(prompts))

    def _loop(self) -> None:
        while True:
            first = self.jobs.get()
            if first is None:
                return
            batch, size = [first], len(first.prompts)
            deadline = time.monotonic() + self.max_wait_s
            while size < self.max_batch:
                try:
                    job = self.jobs.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if job is None:
                    self.jobs.put(None)
                    break
                batch.append(job)
                size += len(job.prompts)
            self._run(batch, size)

    def _run(self, batch: list[_Job], size: int) -> None:
        self.stats["requests"] += len(batch)
        self.stats["samples"] += size
        self.stats["batches"] += 1
        self.stats["largest_batch"] = max(self.stats["largest_batch"], size)
        try:
            scores = self._call(batch)
        except Exception as exc:  # noqa: BLE001 - reported to the client(s)
            self.stats["failed_batches"] += 1
            if len(batch) == 1:
                batch[0].future.set_exception(exc)
                return
            for job in batch:  # isolate the failing request(s)
                try:
                    job.future.set_result(self._call([job]))
                except Exception as one:  # noqa: BLE001
                    job.future.set_exception(one)
            return
        start = 0
        for job in batch:
            job.future.set_result(scores[start:start + len(job.prompts)])
            start += len(job.prompts)


class RewardServer:
    """A ThreadingHTTPServer in front of a Batcher. ``port=0`` picks a free port (see ``.port``)."""

    def __init__(self, reward: Callable[..., Any], name: str, modalities: tuple[str, ...] = ("any",),
                 host: str = "127.0.0.1", port: int = 0, max_batch: int = 32, max_wait_ms: float = 5.0,
                 request_timeout_s: float = 600.0):
        self.name = name
        self.modalities = modalities
        self.batcher = Batcher(reward, max_batch, max_wait_ms)
        self.request_timeout_s = request_timeout_s
        self.token = os.environ.get(TOKEN_ENV) or None
        self.connections: set[Any] = set()
        self._connections_lock = threading.Lock()
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def info(self) -> dict[str, Any]:
        return {"reward": self.name, "modality": list(self.modalities), "uses_inputs": self.batcher.uses_inputs,
                "max_batch": self.batcher.max_batch, **self.batcher.stats}

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> RewardServer:
        """Serve on a daemon thread (tests, embedding)."""
        threading.Thread(target=self.serve_forever, daemon=True, name="omnirl-reward-server").start()
        return self

    def close(self) -> None:
        """Stop listening and drop open keep-alive connections (a client then sees the server gone, as when
        its process ends, instead of a request that never gets an answer)."""
        self.httpd.shutdown()
        self.httpd.server_close()
        with self._connections_lock:
            for connection in list(self.connections):
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self.batcher.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # TCP_NODELAY: a reply's headers and body leave as two writes; with Nagle's algorithm the body waited
            # for the client's delayed ACK of the headers, 40 ms on every call of a kept-alive connection
            disable_nagle_algorithm = True

            def setup(self) -> None:
                super().setup()
                with server._connections_lock:
                    server.connections.add(self.connection)

            def finish(self) -> None:
                with server._connections_lock:
                    server.connections.discard(self.connection)
                super().finish()

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("%s " + format, self.address_string(), *args)

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorised(self) -> bool:
                if server.token is None:
                    return True
                got = self.headers.get("Authorization", "")
                if hmac.compare_digest(got.encode(), f"Bearer {server.token}".encode()):
                    return True
                self._send(401, {"error": f"missing or wrong bearer token (the server requires {TOKEN_ENV})"})
                return False

            def do_GET(self) -> None:
                if self.path.rstrip("/") != "/health":
                    self._send(404, {"error": f"no such endpoint {self.path!r}: GET /health, POST /score"})
                elif self._authorised():
                    self._send(200, server.info())

            def do_POST(self) -> None:
                if self.path.rstrip("/") != "/score":
                    self._send(404, {"error": f"no such endpoint {self.path!r}: GET /health, POST /score"})
                    return
                if not self._authorised():
                    return
                try:
                    length = int(self.headers.get("Content-Length", ""))
                except ValueError:
                    self._send(411, {"error": "a Content-Length header is required"})
                    return
                if length > MAX_BODY:
                    self._send(413, {"error": f"body of {length} bytes is over the {MAX_BODY} byte limit"})
                    return
                try:
                    outputs, prompts, inputs = decode_request(json.loads(self.rfile.read(length)))
                except (WireError, json.JSONDecodeError, UnicodeDecodeError) as exc:
                    self._send(400, {"error": f"bad request: {exc}"})
                    return
                if not prompts:
                    self._send(200, {"scores": []})
                    return
                try:
                    scores = server.batcher.submit(outputs, prompts, inputs).result(server.request_timeout_s)
                except TimeoutError:
                    self._send(504, {"error": f"reward '{server.name}' gave no answer within "
                                              f"{server.request_timeout_s:g} s"})
                except Exception as exc:  # noqa: BLE001 - the reward's own failure, reported to the client
                    self._send(500, {"error": f"reward '{server.name}' failed: {type(exc).__name__}: {exc}"})
                else:
                    self._send(200, {"scores": scores})

        return Handler

