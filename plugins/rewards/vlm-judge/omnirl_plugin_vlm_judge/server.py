"""A stand-in judge with the OpenAI-compatible chat-completions API, for benchmarks and tests on one machine.

It scores an image by its mean brightness b in [0, 1], deterministically, after sleeping a set latency per
request: a stand-in for a VLM judge on other hardware, whose cost to the trainer is its latency. The reply's
content is ``{"score": 10 b}`` (read by parse=number and parse=json with the default templates, both mapping
[0, 10] to [0, 1]); asked for log-probs, it answers "yes" with P(yes) = b (parse=yes-logprob). Not a judge.

    python -m omnirl_plugin_vlm_judge.server --port 8000 --latency-ms 200 [--api-key-env OMNIRL_JUDGE_API_KEY]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from omnirl_core.rewards.server import BodyError, BoundedHTTPServer, body_length

MAX_REQUEST_BYTES = 64 << 20
MAX_CONNECTIONS = 512  # the benchmarks keep hundreds of requests in flight


def brightness(data_url: str) -> float:
    from PIL import Image

    if not data_url.startswith("data:image/") or "," not in data_url:
        raise ValueError("expected a data:image/...;base64 URL")
    image = Image.open(io.BytesIO(base64.b64decode(data_url.split(",", 1)[1]))).convert("RGB")
    return float(np.asarray(image, dtype=np.float32).mean() / 255.0)


def image_url(request: dict[str, Any]) -> str:
    for message in request.get("messages", []):
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                return part["image_url"]["url"]
    raise ValueError("the request holds no image_url content part")


def completion(model: str, score: float, logprobs: bool) -> dict[str, Any]:
    if logprobs:
        p_yes = min(max(score, 1e-6), 1 - 1e-6)
        token = "yes" if p_yes >= 0.5 else "no"
        tops = [{"token": "yes", "logprob": math.log(p_yes)}, {"token": "no", "logprob": math.log(1 - p_yes)}]
        content, lp = token, {"content": [{"token": token, "logprob": max(t["logprob"] for t in tops),
                                           "top_logprobs": tops}]}
    else:
        content, lp = json.dumps({"score": round(10.0 * score, 6)}), None
    return {"id": "stand-in", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": lp,
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}}


def make_server(port: int = 0, latency_s: float = 0.0, api_key: str | None = None,
                host: str = "127.0.0.1") -> ThreadingHTTPServer:
    state = {"requests": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the client's connection pool is used as with vLLM
        disable_nagle_algorithm = True  # TCP_NODELAY: else every reply's body waits 40 ms for the delayed ACK
        timeout = 60.0  # an idle connection is closed

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _reply(self, code: int, payload: dict[str, Any]) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, code: int, message: str) -> None:
            self._reply(code, {"error": {"message": message, "type": "invalid_request_error", "code": code}})

        def do_GET(self) -> None:
            if self.path.rstrip("/").endswith("/models"):
                self._reply(200, {"object": "list", "data": [{"id": "stand-in", "object": "model"}]})
            else:
                self._error(404, "not found")

        def do_POST(self) -> None:
            with lock:
                state["requests"] += 1
            try:  # the reward server's rules: one Content-Length, not negative, within the limit
                length = body_length(self.headers, MAX_REQUEST_BYTES, "")
            except BodyError as exc:
                self.close_connection = True
                self._error(exc.status, str(exc))
                return
            data = self.rfile.read(length)
            if not self.path.rstrip("/").endswith("/chat/completions"):
                self._error(404, f"no route {self.path}")
                return
            if api_key is not None and self.headers.get("Authorization") != f"Bearer {api_key}":
                self._error(401, "invalid API key")
                return
            try:
                request = json.loads(data)
                score = brightness(image_url(request))
            except (ValueError, KeyError, TypeError, OSError) as exc:
                self._error(400, f"bad request: {exc}")
                return
            time.sleep(latency_s)
            self._reply(200, completion(str(request.get("model", "stand-in")), score, bool(request.get("logprobs"))))

    server = BoundedHTTPServer((host, port), Handler, MAX_CONNECTIONS)
    server.state = state  # type: ignore[attr-defined]
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="milliseconds per request")
    parser.add_argument("--api-key-env", default=None, help="require the key held by this environment variable")
    args = parser.parse_args()
    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    server = make_server(args.port, args.latency_ms / 1000.0, key, args.host)
    print(f"stand-in judge on http://{args.host}:{server.server_address[1]}/v1", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
