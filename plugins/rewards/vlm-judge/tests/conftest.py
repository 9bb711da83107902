"""A fault-injecting OpenAI-compatible judge: a real HTTP server on 127.0.0.1 in a thread.

Modes (``judge.mode``): ok, slow (``latency_s``), fail-then-ok (``fail_first`` replies of ``fail_status``),
always-500 (their bodies quote the Authorization header back), garbage (not JSON), malformed (JSON without choices), no-choices, two-choices, trickle (a 200
whose body comes one byte every ``trickle_s``), trickle-headers (the status line itself trickles), redirect
(302 to ``location``), huge (a 50 MB body, streamed until the client hangs up), huge-declared (the same with
Content-Length), echo (401 whose body quotes the Authorization header back, passed through ``echo``: raw by
default, or encoded as the test chooses), echo-raw (a 401 whose whole body is ``echo(header)``), echo-reply (a 200 whose content quotes it). It records each request's
Authorization header and JSON body.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

HUGE = 50 << 20


def completion(content: str | None = "7", logprobs: Any = None, n: int = 1) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
              "finish_reason": "stop"}
    return {"id": "x", "object": "chat.completion", "model": "m", "choices": [choice] * n}


class FaultJudge:
    def __init__(self) -> None:
        self.mode = "ok"
        self.content: str | None = "7"
        self.logprobs: Any = None
        self.latency_s = 0.0
        self.fail_first = 0
        self.fail_status = 500
        self.trickle_s = 1.5
        self.location = ""
        self.echo: Callable[[str], str] = lambda auth: auth
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.bytes_sent = 0
        self.huge = HUGE
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    @property
    def auth_headers(self) -> list[str | None]:
        return [r["authorization"] for r in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: bytes, content_type: str = "application/json",
                      extra: dict[str, str] | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                for key, value in (extra or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def _json(self, code: int, payload: Any) -> None:
                self._send(code, json.dumps(payload).encode())

            def _stream(self, total: int, chunk: bytes) -> None:
                try:
                    while judge.bytes_sent < total:
                        self.wfile.write(chunk)
                        judge.bytes_sent += len(chunk)
                except OSError:  # the client hung up
                    pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                auth = self.headers.get("Authorization")
                with judge._lock:
                    judge.requests.append({"authorization": auth, "path": self.path, "body": json.loads(body)})
                    count = len(judge.requests)
                    judge.in_flight += 1
                    judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
                try:
                    self._serve(judge.mode, count, auth)
                finally:
                    with judge._lock:
                        judge.in_flight -= 1

            def _serve(self, mode: str, count: int, auth: str | None) -> None:
                if mode == "slow":
                    time.sleep(judge.latency_s)
                if mode in ("ok", "slow") or (mode == "fail-then-ok" and count > judge.fail_first):
                    self._json(200, completion(judge.content, judge.logprobs))
                elif mode in ("fail-then-ok", "always-500"):
                    status = judge.fail_status if mode == "fail-then-ok" else 500
                    self._json(status, {"error": {"message": f"internal error (request had {auth})"}})
                elif mode == "garbage":
                    self._send(200, b"<html><body>502 Bad Gateway</body></html>", "text/html")
                elif mode == "malformed":
                    self._json(200, {"id": "x", "object": "chat.completion", "result": "7"})
                elif mode == "no-choices":
                    self._json(200, {"id": "x", "choices": []})
                elif mode == "two-choices":
                    self._json(200, completion("7", n=2))
                elif mode == "trickle":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "4096")
                    self.end_headers()
                    self.wfile.flush()
                    self._trickle(b" " * 4096)
                elif mode == "trickle-headers":
                    self._trickle(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + b"X-Pad: x" * 512)
                elif mode == "redirect":
                    self._send(302, b"", extra={"Location": judge.location})
                elif mode in ("huge", "huge-declared"):
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    if mode == "huge-declared":
                        self.send_header("Content-Length", str(HUGE))
                    self.end_headers()
                    self._stream(HUGE, b"[" * 65536)
                elif mode == "echo":
                    self._json(401, {"error": {"message": f"invalid credentials: {judge.echo(auth or '')}"}})
                elif mode == "echo-raw":
                    self._send(401, judge.echo(auth or "").encode())
                elif mode == "echo-reply":
                    self._json(200, completion(f"I was called with {judge.echo(auth or '')}, no opinion"))
                else:
                    raise AssertionError(mode)

            def _trickle(self, data: bytes) -> None:
                try:
                    for i in range(len(data)):
                        self.wfile.write(data[i:i + 1])
                        self.wfile.flush()
                        time.sleep(judge.trickle_s)
                except OSError:
                    pass

        return Handler


@pytest.fixture
def fake_judge():
    """``fake_judge()`` starts a fault-injecting judge; every one started is shut down after the test."""
    started: list[FaultJudge] = []

    def start() -> FaultJudge:
        started.append(FaultJudge())
        return started[-1]

    yield start
    for judge in started:
        judge.close()
