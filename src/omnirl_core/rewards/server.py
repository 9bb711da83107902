"""``omnirl reward serve NAME``: any installed reward over HTTP (wire format: ``omnirl_core.rewards.wire``).

A reward model with conflicting dependencies or its own GPU then runs in its own environment, and a run
reaches it with the ``remote`` reward. The reward is called as in process: with the same tensors (dtype, shape,
bits), and with the batch each request carries. Only a reward that says a sample's score never depends on
what shares its call (``batch_invariant = True``) has the requests that arrive together merged into one call:
a batcher thread takes every waiting request (up to ``max_batch`` samples, waiting at most ``max_wait_ms`` for
more after the first); when such a batch fails, each request is scored alone, so a bad request fails only
itself. The reward is never called from two threads at once.

The HTTP server is uvicorn (its public ``Config`` / ``Server``, its h11 parser) running ``RewardApp``, a
plain ASGI app, on an event loop of its own thread. The app decides, and answers with a JSON ``error``: 401
(bearer token), 404, 405, 415, 411 / 400 / 413 (``Content-Length``: one, a number, at most
``max_body_bytes``, checked before any of the body is read; no chunked bodies), 400 (a body that does not
follow the wire format), 408 (nothing arrived for ``idle_timeout_s`` in the middle of a body), 503 (the
bodies held at once would pass ``max_body_bytes`` for ``request_timeout_s``), 500 (the reward's own error),
504 (no answer within ``request_timeout_s``). A body is read as it arrives: one of up to ``SMALL_BODY``
whole, then parsed on the event loop; a larger one by ``wire.read_request`` on a reader thread, its tensors'
bytes copied from the connection straight into one buffer.

uvicorn itself answers, in plain text, what happens below the app: a request line or headers it cannot
parse, or that take more than ``MAX_HEAD`` (``400 Invalid HTTP request received.``; a negative, non-numeric
or doubled ``Content-Length`` is one), and a request on a connection past ``max_connections`` (``503 Service
Unavailable``, connection closed; the remote reward retries it). A connection kept alive after an answer is
closed after ``idle_timeout_s`` of silence (uvicorn's ``timeout_keep_alive``); a connection that never sends
a request is held until its client closes it (uvicorn has no timeout for that; it counts against
``max_connections``). ``close`` stops listening, closes the idle connections, lets the requests in flight
finish (for up to ``SHUTDOWN_GRACE_S``) and stops the batcher.

Files shipped with a request (the records' media: an edit's source and mask, a reference voice) are written to a
directory of the request's own (``shipped_files``), which its records then name, and removed once it is scored.

With ``OMNIRL_REWARD_SERVER_TOKEN`` in the server's environment, every request must carry
``Authorization: Bearer <token>`` (the remote reward sends it from the same variable); the token is never
printed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import queue
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol, overload

from omnirl_core.contracts import as_reward
from omnirl_core.contracts.data import MEDIA_KEYS
from omnirl_core.rewards.dispatch import check_scores
from omnirl_core.rewards.wire import CONTENT_TYPE, WireError, read_request

log = logging.getLogger("omnirl.reward_server")
TOKEN_ENV = "OMNIRL_REWARD_SERVER_TOKEN"
# 64 float32 images of 1024x1024 (a request of the remote reward's default batch_size at that size) take 805 MB
MAX_BODY = 1 << 30
IDLE_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 64
# a request's line and headers, in bytes: h11 holds at most this much of a head (httptools, which uvicorn also
# offers, holds a header of any length: a client could make the server hold any amount of memory before the app
# sees the request)
MAX_HEAD = 64 << 10
SMALL_BODY = 1 << 20  # bodies up to this size are read whole and parsed on the event loop (no thread hand-off)
SHUTDOWN_GRACE_S = 5.0
BACKLOG = 128  # the listen backlog: a burst of clients must not wait seconds to connect

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class BodyError(Exception):
    """A request whose body the server will not read: ``status`` and the reason."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


HINT_413 = ("the server's --max-body-mb; send fewer samples per request (the remote reward's batch_size) or raise "
            "it")


class Headers(Protocol):
    """Request headers as ``email.message.Message`` gives them (``http.server``'s ``self.headers``)."""

    def get(self, name: str, /) -> str | None: ...

    def get_all(self, name: str, /) -> list[str] | None: ...


class AsgiHeaders:
    """An ASGI request's headers, read as ``email.message.Message`` reads them (names case-insensitive)."""

    def __init__(self, raw: Iterable[tuple[bytes, bytes]]):
        self.items = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in raw]

    @overload
    def get(self, name: str, /) -> str | None: ...

    @overload
    def get(self, name: str, default: str, /) -> str: ...

    def get(self, name: str, default: str | None = None, /) -> str | None:
        name = name.lower()
        return next((v for k, v in self.items if k == name), default)

    def get_all(self, name: str, /) -> list[str] | None:
        name = name.lower()
        return [v for k, v in self.items if k == name] or None


def body_length(headers: Headers, limit: int, hint: str = HINT_413) -> int:
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


_Request = socket.socket | tuple[bytes, socket.socket]
"""What socketserver hands a server per request (a TCP server's is the connection's socket)."""


class BoundedHTTPServer(ThreadingHTTPServer):
    """For small stdlib ``http.server`` services (stand-ins in tests and benchmarks; the reward server is
    uvicorn): a ThreadingHTTPServer (daemon threads) that serves at most ``max_connections`` connections at once:
    one more is answered ``503`` and closed by the listening thread, without a thread of its own. Handlers set
    their idle timeout with the ``timeout`` class attribute (``BaseHTTPRequestHandler`` closes a connection idle
    that long)."""

    daemon_threads = True
    block_on_close = False  # close() must not wait for handlers that wait on a slow answer
    request_queue_size = BACKLOG

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
        body = json.dumps({"error": f"the server has {self.max_connections} connections open, its limit; "
                                    "retry later"}).encode()
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
    """Bytes of request bodies held at once (used on the event loop only)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self._free = asyncio.Condition()

    async def acquire(self, n: int, timeout_s: float) -> bool:
        async with self._free:
            try:
                await asyncio.wait_for(self._free.wait_for(lambda: self.held + n <= self.limit), timeout_s)
            except TimeoutError:
                return False
            self.held += n
            return True

    async def release(self, n: int) -> None:
        async with self._free:
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


class _Gone(Exception):
    """The client went away in the middle of its body (nothing to answer)."""


class _BodyReader:
    """A request body from ASGI ``receive``: whole (``read_all``), or copied into the views a reader thread
    asks for (``fill``, run on the event loop). Raises TimeoutError when nothing arrives for ``idle_s`` and
    _Gone when the client disconnects."""

    def __init__(self, receive: Receive, idle_s: float):
        self.receive = receive
        self.idle_s = idle_s
        self.pending = memoryview(b"")
        self.ended = False

    async def _next(self) -> None:
        message = await asyncio.wait_for(self.receive(), self.idle_s)
        if message["type"] == "http.disconnect":
            raise _Gone
        self.pending = memoryview(message.get("body", b""))
        self.ended = not message.get("more_body", False)

    async def fill(self, view: memoryview) -> int:
        done = 0
        while done < len(view):
            if not self.pending:
                if self.ended:
                    break
                await self._next()
                continue
            n = min(len(self.pending), len(view) - done)
            view[done:done + n] = self.pending[:n]
            self.pending = self.pending[n:]
            done += n
        return done

    async def read_all(self, length: int) -> memoryview:
        data = bytearray(length)
        return memoryview(data)[:await self.fill(memoryview(data))]


def _from(data: memoryview) -> Callable[[memoryview], int]:
    """A ``readinto`` over bytes held in memory."""
    at = 0

    def read_into(view: memoryview) -> int:
        nonlocal at
        n = min(len(view), len(data) - at)
        view[:n] = data[at:at + n]
        at += n
        return n

    return read_into


class RewardApp:
    """The reward server's ASGI app: GET /health, POST /score (see the module's docstring)."""

    def __init__(self, batcher: Batcher, name: str, modalities: tuple[str, ...], request_timeout_s: float,
                 max_body_bytes: int, idle_timeout_s: float, readers: int):
        self.batcher = batcher
        self.name = name
        self.modalities = modalities
        self.request_timeout_s = request_timeout_s
        self.max_body_bytes = max_body_bytes
        self.idle_timeout_s = idle_timeout_s
        self.budget = _Budget(max_body_bytes)
        self.token = os.environ.get(TOKEN_ENV) or None
        self.readers = ThreadPoolExecutor(readers, thread_name_prefix="omnirl-reward-reader")

    def info(self) -> dict[str, Any]:
        return {"reward": self.name, "modality": list(self.modalities), "uses_inputs": self.batcher.uses_inputs,
                "batch_invariant": self.batcher.batch_invariant, "max_batch": self.batcher.max_batch,
                "max_body_bytes": self.max_body_bytes, **self.batcher.stats}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off; anything else is not served
            return
        headers = AsgiHeaders(scope["headers"])
        answer = await self._answer(scope, headers, receive)
        if answer is None:  # the client went away
            return
        status, body, close = answer
        data = json.dumps(body).encode()
        response = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        if close:  # a body left (partly) unread: uvicorn closes the connection after the answer
            response.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": response})
        await send({"type": "http.response.body", "body": data})

    async def _answer(self, scope: Scope, headers: AsgiHeaders,
                      receive: Receive) -> tuple[int, dict[str, Any], bool] | None:
        path, method = scope["path"].rstrip("/"), scope["method"]
        unread = headers.get("Transfer-Encoding") is not None or headers.get("Content-Length", "0").strip() != "0"
        if method not in ("GET", "POST", "HEAD"):
            return 405, {"error": f"{method[:20]} is not served: GET /health, POST /score"}, True
        if path != ("/score" if method == "POST" else "/health"):
            return 404, {"error": f"no such endpoint {scope['path'][:200]!r}: GET /health, POST /score"}, unread
        if self.token is not None and not hmac.compare_digest(headers.get("Authorization", "").encode(),
                                                              f"Bearer {self.token}".encode()):
            return 401, {"error": f"missing or wrong bearer token (the server requires {TOKEN_ENV})"}, unread
        if method != "POST":
            return 200, self.info(), unread
        kind = headers.get("Content-Type", "").split(";")[0].strip().lower()
        if kind != CONTENT_TYPE:
            return 415, {"error": f"the body must be {CONTENT_TYPE} (a safetensors file, see "
                                  f"omnirl_core.rewards.wire), not {kind[:80] or 'untyped'}"}, True
        try:
            length = body_length(headers, self.max_body_bytes)
        except BodyError as exc:
            return exc.status, {"error": str(exc)}, True
        if not await self.budget.acquire(length, self.request_timeout_s):
            return 503, {"error": f"the server held {self.max_body_bytes} bytes of requests for "
                                  f"{self.request_timeout_s:g} s; retry later"}, True
        try:
            status, body = await self.score(_BodyReader(receive, self.idle_timeout_s), length)
        except TimeoutError:
            return 408, {"error": f"nothing arrived for {self.idle_timeout_s:g} s in the middle of the body"}, True
        except _Gone:
            return None
        finally:
            await self.budget.release(length)
        return status, body, status == 400

    async def score(self, reader: _BodyReader, length: int) -> tuple[int, dict[str, Any]]:
        """One /score body -> (status, answer). Raises TimeoutError / _Gone when the connection fails while the
        body is read. Nothing of the request is left alive when it returns."""
        try:
            if length <= SMALL_BODY:
                outputs, prompts, inputs, files = read_request(_from(await reader.read_all(length)), length)
            else:
                loop = asyncio.get_running_loop()

                def read_into(view: memoryview) -> int:
                    return asyncio.run_coroutine_threadsafe(reader.fill(view), loop).result()

                outputs, prompts, inputs, files = await loop.run_in_executor(self.readers, read_request, read_into,
                                                                             length)
        except WireError as exc:
            return 400, {"error": f"bad request: {exc}"}
        except (TimeoutError, _Gone):  # the connection
            raise
        except Exception as exc:  # noqa: BLE001 - what the checks did not foresee is still the client's input
            return 400, {"error": f"bad request: {type(exc).__name__}: {exc}"}
        if not prompts:
            return 200, {"scores": []}
        directory = None
        if files and inputs is not None and self.batcher.uses_inputs:
            inputs, directory = await asyncio.get_running_loop().run_in_executor(self.readers, shipped_files, inputs,
                                                                                files)
        del files
        job = self.batcher.submit(outputs, prompts, inputs)
        if directory is not None:  # once the batcher is done with the request (it may outlive a 504)
            job.add_done_callback(lambda _: shutil.rmtree(directory, ignore_errors=True))
        future = asyncio.wrap_future(job)
        del outputs, inputs
        done, _ = await asyncio.wait({future}, timeout=self.request_timeout_s)  # not cancelled: the batcher owns it
        if not done:
            return 504, {"error": f"reward '{self.name}' gave no answer within {self.request_timeout_s:g} s"}
        try:
            return 200, {"scores": future.result()}
        except Exception as exc:  # noqa: BLE001 - the reward's own failure, reported to the client
            return 500, {"error": f"reward '{self.name}' failed: {type(exc).__name__}: {exc}"}


def shipped_files(inputs: list[Any], files: dict[str, Any]) -> tuple[list[Any], str]:
    """Writes a request's shipped files (path -> uint8 tensor of the file's bytes) to a new directory and returns
    the records with their media fields (``MEDIA_KEYS``) naming the copies, and the directory. A copy is named by
    its order and the path's suffix only: nothing of the client's path reaches this machine's file system."""
    directory = tempfile.mkdtemp(prefix="omnirl-reward-files-")
    copies: dict[str, str] = {}
    for k, (path, data) in enumerate(files.items()):
        suffix = re.sub(r"[^A-Za-z0-9]", "", os.path.splitext(path)[1])[:12]
        copies[path] = os.path.join(directory, f"{k}.{suffix}" if suffix else str(k))
        with open(copies[path], "wb") as f:
            f.write(memoryview(data.numpy()))

    def local(value: object) -> object:
        if isinstance(value, str):
            return copies.get(value, value)
        return [local(v) for v in value] if isinstance(value, list) else value

    records = [{k: local(v) if k in MEDIA_KEYS else v for k, v in r.items()} if isinstance(r, dict) else r
               for r in inputs]
    return records, directory


class RewardServer:
    """uvicorn serving a RewardApp in front of a Batcher. ``port=0`` picks a free port (see ``.port``); the
    socket is bound here, so ``.url`` is known before serving."""

    def __init__(self, reward: Callable[..., Any], name: str, modalities: tuple[str, ...] = ("any",),
                 host: str = "127.0.0.1", port: int = 0, max_batch: int = 32, max_wait_ms: float = 5.0,
                 request_timeout_s: float = 600.0, max_body_bytes: int = MAX_BODY,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS):
        import uvicorn

        if max_body_bytes < 8 or idle_timeout_s <= 0 or max_connections < 1:
            raise ValueError("max_body_bytes must be at least 8, idle_timeout_s positive and max_connections at "
                             "least 1")
        self.name = name
        self.batcher = Batcher(reward, max_batch, max_wait_ms)
        self.app = RewardApp(self.batcher, name, modalities, request_timeout_s, max_body_bytes, idle_timeout_s,
                             readers=max_connections)
        self.max_connections = max_connections
        self.socket = socket.create_server((host, port), backlog=BACKLOG)
        self.host, self.port = self.socket.getsockname()[:2]
        self.config = uvicorn.Config(
            self.app, http="h11", lifespan="off", log_config=None,
            access_log=False, server_header=False, timeout_keep_alive=idle_timeout_s,  # type: ignore[arg-type]
            # uvicorn answers 503 once the connections open (this one counted) reach limit_concurrency
            limit_concurrency=max_connections + 1, timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S),
            h11_max_incomplete_event_size=MAX_HEAD, backlog=BACKLOG)
        self.server = uvicorn.Server(self.config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def budget(self) -> _Budget:
        return self.app.budget

    def info(self) -> dict[str, Any]:
        return self.app.info()

    def open_connections(self) -> int:
        """Connections open now (idle ones included)."""
        return len(self.server.server_state.connections)

    def serve_forever(self) -> None:
        """Serve on this thread until ``close`` (or, on the main thread, SIGINT / SIGTERM: uvicorn shuts down
        gracefully, then raises the signal again)."""
        try:
            self.server.run(sockets=[self.socket])
        finally:
            self.socket.close()
            self.app.readers.shutdown(wait=False, cancel_futures=True)
            self.batcher.close()

    def start(self) -> RewardServer:
        """Serve on a daemon thread (tests, embedding); returns once the server accepts requests."""
        self._thread = threading.Thread(target=self.serve_forever, daemon=True, name="omnirl-reward-server")
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError(f"the reward server on {self.url} did not start")
        return self

    def close(self) -> None:
        """Stop listening, close the idle connections, let the requests in flight finish (up to
        SHUTDOWN_GRACE_S), stop the batcher."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(SHUTDOWN_GRACE_S + 5)
