"""``omnirl reward serve NAME``: any installed reward over HTTP (wire format: ``omnirl_core.rewards.wire``).

A reward model with conflicting dependencies or its own GPU then runs in its own environment, and a run
reaches it with the ``remote`` reward. The reward is called as in process: with the same tensors (dtype, shape,
bits), and with the batch each request carries. Only a reward that says a sample's score never depends on
what shares its call (``batch_invariant = True``) has the requests that arrive together merged into one call:
a batcher thread takes every waiting request (up to ``max_batch`` samples, waiting at most ``max_wait_ms`` for
more after the first); when such a batch fails, each request is scored alone, so a bad request fails only
itself. The reward is never called from two threads at once.

What a client can make the server hold is bounded: a body needs a ``Content-Length`` of at most
``max_body_bytes`` (no chunked bodies), the bodies held at once take at most ``max_body_bytes`` together (a
request past that waits its turn), a body is read as it arrives (``wire.read_request``: its header checked
first, its tensors' bytes read into one buffer, nothing else kept), a connection that sends nothing for
``idle_timeout_s`` is closed, and at most ``max_connections`` are served at once (one more is answered 503
at once, without a thread). Every request the server cannot use gets a 4xx with a JSON ``error``.

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
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

from omnirl_core.contracts import as_reward
from omnirl_core.rewards.dispatch import check_scores
from omnirl_core.rewards.wire import CONTENT_TYPE, WireError, read_request

log = logging.getLogger("omnirl.reward_server")
TOKEN_ENV = "OMNIRL_REWARD_SERVER_TOKEN"
# 64 float32 images of 1024x1024 (a request of the remote reward's default batch_size at that size) take 805 MB
MAX_BODY = 1 << 30
IDLE_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 64


class BodyError(Exception):
    """A request whose body the server will not read: ``status`` and the reason."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


HINT_413 = ("the server's --max-body-mb; send fewer samples per request (the remote reward's batch_size) or raise "
            "it")


def body_length(headers: Message, limit: int, hint: str = HINT_413) -> int:
    """The length of a request's body from its headers: one ``Content-Length`` of at most ``limit`` bytes;
    raises BodyError (411 without one or with a chunked body, 400 for a malformed one, 413 over the limit, the
    message ending with ``hint``)."""
    if headers.get("Transfer-Encoding") is not None:
        raise BodyError(411, "chunked bodies (Transfer-Encoding) are not accepted: send a Content-Length")
    values = {v.strip() for v in headers.get_all("Content-Length") or []}
    if not values:
        raise BodyError(411, "a Content-Length header is required")
    if len(values) > 1:
        raise BodyError(400, f"conflicting Content-Length headers ({', '.join(sorted(values))[:80]})")
    value = values.pop()
    if not (value.isascii() and value.isdigit()):
        raise BodyError(400, f"Content-Length {value[:40]!r} is not a number of bytes")
    length = int(value)
    if length > limit:
        raise BodyError(413, f"a body of {length} bytes is over the {limit} byte limit{f' ({hint})' if hint else ''}")
    return length


def has_body(headers: Message) -> bool:
    """The request announces a body (one a handler that does not read it must close the connection over)."""
    return headers.get("Transfer-Encoding") is not None or headers.get("Content-Length", "0").strip() != "0"


_Request = socket.socket | tuple[bytes, socket.socket]
"""What socketserver hands a server per request (a TCP server's is the connection's socket)."""


class BoundedHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer (daemon threads) that serves at most ``max_connections`` connections at once: one more
    is answered ``503`` and closed by the listening thread, without a thread of its own. Handlers set their idle
    timeout with the ``timeout`` class attribute (``BaseHTTPRequestHandler`` closes a connection idle that long)."""

    daemon_threads = True
    block_on_close = False  # close() must not wait for handlers that wait on a reward
    request_queue_size = 128  # the listen backlog (socketserver's 5 made a burst of clients wait seconds to connect)

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int):
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.max_connections = max_connections
        self.refused = 0
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: _Request, client_address: tuple[str, int]) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: _Request, client_address: tuple[str, int]) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: _Request) -> None:
        body = json.dumps({"error": f"the server has {self.max_connections} connections open, its limit "
                                    "(--max-connections); retry later"}).encode()
        conn = request if isinstance(request, socket.socket) else request[1]
        try:
            conn.settimeout(1.0)
            conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                         b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            conn.setblocking(False)
            while conn.recv(1 << 16):  # what the client sent already: a close with unread data resets
                pass
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request: _Request, client_address: tuple[str, int]) -> None:
        """A client that hangs up or stalls mid-reply is its own business (socketserver printed a traceback)."""
        import sys

        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.debug("connection from %s failed: %s", client_address, error)
        else:
            log.error("error while serving %s", client_address, exc_info=error)


class _Budget:
    """Bytes of request bodies held at once."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self._free = threading.Condition()

    def acquire(self, n: int, timeout_s: float) -> bool:
        with self._free:
            return self._free.wait_for(lambda: self.held + n <= self.limit, timeout_s) and self._take(n)

    def _take(self, n: int) -> bool:
        self.held += n
        return True

    def release(self, n: int) -> None:
        with self._free:
            self.held -= n
            self._free.notify_all()


@dataclass
class _Job:
    outputs: list[Any]
    prompts: list[str]
    inputs: list[Any] | None
    future: Future = field(default_factory=Future)


class Batcher:
    """Calls the reward on one thread: one call per request, or, for a ``batch_invariant`` reward, one call per
    group of requests that arrive together."""

    def __init__(self, reward: Callable[..., Any], max_batch: int = 32, max_wait_ms: float = 5.0):
        self.reward = reward
        reward = as_reward(reward)  # a plain callable: every capability at its default
        self.uses_inputs = reward.uses_inputs
        self.batch_invariant = reward.batch_invariant
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

    def _collect(self, first: _Job) -> list[_Job]:
        batch, size = [first], len(first.prompts)
        deadline = time.monotonic() + self.max_wait_s
        while self.batch_invariant and size < self.max_batch:
            try:
                job = self.jobs.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None:
                self.jobs.put(None)
                break
            batch.append(job)
            size += len(job.prompts)
        return batch

    def _loop(self) -> None:
        while True:
            first = self.jobs.get()
            if first is None:
                return
            self._run(self._collect(first))
            del first  # nothing of a scored request stays alive while the thread waits for the next

    def _run(self, batch: list[_Job]) -> None:
        size = sum(len(job.prompts) for job in batch)
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
    """A BoundedHTTPServer in front of a Batcher. ``port=0`` picks a free port (see ``.port``)."""

    def __init__(self, reward: Callable[..., Any], name: str, modalities: tuple[str, ...] = ("any",),
                 host: str = "127.0.0.1", port: int = 0, max_batch: int = 32, max_wait_ms: float = 5.0,
                 request_timeout_s: float = 600.0, max_body_bytes: int = MAX_BODY,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS):
        if max_body_bytes < 8 or idle_timeout_s <= 0:
            raise ValueError("max_body_bytes must be at least 8 and idle_timeout_s positive")
        self.name = name
        self.modalities = modalities
        self.batcher = Batcher(reward, max_batch, max_wait_ms)
        self.request_timeout_s = request_timeout_s
        self.max_body_bytes = max_body_bytes
        self.idle_timeout_s = idle_timeout_s
        self.budget = _Budget(max_body_bytes)
        self.token = os.environ.get(TOKEN_ENV) or None
        self.connections: set[Any] = set()
        self._connections_lock = threading.Lock()
        self.httpd = BoundedHTTPServer((host, port), self._handler(), max_connections)
        self.host, self.port = cast("tuple[str, int]", self.httpd.server_address[:2])  # AF_INET: a str host

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def info(self) -> dict[str, Any]:
        return {"reward": self.name, "modality": list(self.modalities), "uses_inputs": self.batcher.uses_inputs,
                "batch_invariant": self.batcher.batch_invariant, "max_batch": self.batcher.max_batch,
                "max_body_bytes": self.max_body_bytes, **self.batcher.stats}

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

    def score(self, read_into: Callable[[memoryview], int], length: int) -> tuple[int, dict[str, Any]]:
        """One /score body -> (status, answer). Raises TimeoutError / OSError when the connection fails while
        the body is read. Nothing of the request is left alive when it returns."""
        try:
            outputs, prompts, inputs = read_request(read_into, length)
        except WireError as exc:
            return 400, {"error": f"bad request: {exc}"}
        except OSError:  # the connection: the handler closes it
            raise
        except Exception as exc:  # noqa: BLE001 - what the checks did not foresee is still the client's input
            return 400, {"error": f"bad request: {type(exc).__name__}: {exc}"}
        if not prompts:
            return 200, {"scores": []}
        future = self.batcher.submit(outputs, prompts, inputs)
        del outputs, inputs
        try:
            return 200, {"scores": future.result(self.request_timeout_s)}
        except TimeoutError:
            return 504, {"error": f"reward '{self.name}' gave no answer within {self.request_timeout_s:g} s"}
        except Exception as exc:  # noqa: BLE001 - the reward's own failure, reported to the client
            return 500, {"error": f"reward '{self.name}' failed: {type(exc).__name__}: {exc}"}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # TCP_NODELAY: a reply's headers and body leave as two writes; with Nagle's algorithm the body waited
            # for the client's delayed ACK of the headers, 40 ms on every call of a kept-alive connection
            disable_nagle_algorithm = True
            timeout = server.idle_timeout_s  # per read and write: an idle connection is closed

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

            def _send(self, status: int, body: dict[str, Any], close: bool = False) -> None:
                """``close``: the connection ends after this reply (a body left unread must not be taken for the
                next request)."""
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if close:
                    self.send_header("Connection", "close")  # sets close_connection
                self.end_headers()
                self.wfile.write(data)

            def _authorised(self) -> bool:
                if server.token is None:
                    return True
                got = self.headers.get("Authorization", "")
                if hmac.compare_digest(got.encode(), f"Bearer {server.token}".encode()):
                    return True
                self._send(401, {"error": f"missing or wrong bearer token (the server requires {TOKEN_ENV})"},
                           close=has_body(self.headers))
                return False

            def _no_such(self) -> None:
                self._send(404, {"error": f"no such endpoint {self.path[:200]!r}: GET /health, POST /score"},
                           close=has_body(self.headers))

            def do_GET(self) -> None:
                if self.path.rstrip("/") != "/health":
                    self._no_such()
                elif self._authorised():
                    self._send(200, server.info(), close=has_body(self.headers))

            def _not_allowed(self) -> None:
                self._send(405, {"error": f"{self.command} is not served: GET /health, POST /score"}, close=True)

            do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

            def do_POST(self) -> None:
                if self.path.rstrip("/") != "/score":
                    self._no_such()
                    return
                if not self._authorised():
                    return
                kind = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
                if kind != CONTENT_TYPE:
                    self._send(415, {"error": f"the body must be {CONTENT_TYPE} (a safetensors file, see "
                                              f"omnirl_core.rewards.wire), not {kind[:80] or 'untyped'}"}, close=True)
                    return
                try:
                    length = body_length(self.headers, server.max_body_bytes)
                except BodyError as exc:
                    self._send(exc.status, {"error": str(exc)}, close=True)
                    return
                if not server.budget.acquire(length, server.request_timeout_s):
                    self._send(503, {"error": f"the server held {server.max_body_bytes} bytes of requests for "
                                              f"{server.request_timeout_s:g} s; retry later"}, close=True)
                    return
                try:
                    status, answer = server.score(self.rfile.readinto, length)
                except TimeoutError:
                    self._send(408, {"error": f"nothing arrived for {server.idle_timeout_s:g} s in the middle of "
                                              "the body"}, close=True)
                    return
                except OSError:  # the client went away mid-body
                    self.close_connection = True
                    return
                finally:
                    server.budget.release(length)
                self._send(status, answer, close=status == 400)

        return Handler
