"""A stand-in judge service speaking the same JSON protocol, for tests and benchmarks on one machine.

It scores an image by its mean brightness after sleeping ``latency_s`` per request: a stand-in for a VLM
judge running on other hardware, whose cost to the trainer is its latency. Not a real judge.

    python -m omnirl_plugin_http_judge.server --port 8000 --latency 0.2 [--api-key-env VAR]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np


def make_server(port: int = 0, latency_s: float = 0.0, api_key: str | None = None,
                fail_first: int = 0) -> ThreadingHTTPServer:
    """``fail_first``: answer that many requests with 503 first (to exercise retries)."""
    state = {"failures_left": fail_first, "requests": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _reply(self, code: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            from PIL import Image

            with lock:
                state["requests"] += 1
                failing = state["failures_left"] > 0
                state["failures_left"] -= failing
            if failing:
                self._reply(503, {"error": "warming up"})
                return
            if api_key is not None and self.headers.get("Authorization") != f"Bearer {api_key}":
                self._reply(401, {"error": "bad key"})
                return
            try:
                payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                image = Image.open(io.BytesIO(base64.b64decode(payload["image"]))).convert("RGB")
            except (ValueError, KeyError, OSError):
                self._reply(400, {"error": "expected JSON with a base64 PNG 'image'"})
                return
            time.sleep(latency_s)
            self._reply(200, {"score": float(np.asarray(image, dtype=np.float32).mean() / 255.0)})

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.state = state  # type: ignore[attr-defined]
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per request")
    parser.add_argument("--api-key-env", default=None, help="require the key held by this variable")
    args = parser.parse_args()
    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    server = make_server(args.port, args.latency, key)
    print(f"judge stand-in on http://127.0.0.1:{server.server_address[1]}/score", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
