"""A remote judge over HTTP. One request per image, so that streamed samples are judged as they finish.

Request (POST, JSON): ``{"prompt": str, "image": base64 PNG, "format": "png"}``, with
``Authorization: Bearer <key>`` when a key is set. Reply (JSON): ``{"score": float}``.
Only JSON crosses the wire. Transient failures (connection errors, 429, 5xx) are retried with backoff;
anything else fails the call with a message naming the URL and status, never the key.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, SecretStr

RETRY_STATUS = {429, 500, 502, 503, 504}


class HTTPJudgeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field("http://127.0.0.1:8000/score", description="The judge's scoring endpoint (POST).")
    api_key: SecretStr | None = Field(
        None, description="API key sent as a Bearer token; redacted in saved configs. Prefer api_key_env."
    )
    api_key_env: str = Field("OMNIRL_JUDGE_API_KEY", description="Environment variable holding the API key "
                             "(used when api_key is unset; unset variable: no key).")
    timeout_s: float = Field(60.0, gt=0, description="Seconds to wait for one reply.")
    retries: int = Field(2, ge=0, description="Retries of a transient failure (connection, 429, 5xx).")
    score_field: str = Field("score", description="Field of the JSON reply that holds the score.")


def encode_png(output: Any) -> str:
    """(3, H, W) in [0, 1] (a tensor or an array) -> base64 PNG."""
    from PIL import Image

    array = output.detach().cpu().float().numpy() if hasattr(output, "detach") else np.asarray(output)
    if array.ndim == 3 and array.shape[0] in (1, 3):
        array = np.transpose(array, (1, 2, 0))
    image = Image.fromarray((np.clip(array, 0, 1) * 255).round().astype(np.uint8).squeeze())
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class JudgeError(RuntimeError):
    pass


class HTTPJudge:
    def __init__(self, options: HTTPJudgeOptions | None = None):
        self.options = options or HTTPJudgeOptions()
        key = self.options.api_key
        if key is None and os.environ.get(self.options.api_key_env):
            key = SecretStr(os.environ[self.options.api_key_env])
        self._key = key

    def __repr__(self) -> str:  # never show the key
        return f"HTTPJudge(url={self.options.url!r}, api_key={'**********' if self._key else None})"

    def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        body = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._key is not None:
            headers["Authorization"] = f"Bearer {self._key.get_secret_value()}"
        url = self.options.url
        for attempt in range(self.options.retries + 1):
            request = urllib.request.Request(url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.options.timeout_s) as reply:
                    return json.loads(reply.read().decode())
            except urllib.error.HTTPError as exc:
                if exc.code not in RETRY_STATUS or attempt == self.options.retries:
                    raise JudgeError(f"judge at {url} answered HTTP {exc.code} {exc.reason}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                if attempt == self.options.retries:
                    raise JudgeError(f"judge at {url} unreachable: {exc}") from None
            time.sleep(min(0.2 * 2**attempt, 2.0))
        raise AssertionError("unreachable")

    def score_one(self, output: Any, prompt: str) -> float:
        reply = self._post({"prompt": prompt, "image": encode_png(output), "format": "png"})
        value = reply.get(self.options.score_field) if isinstance(reply, dict) else None
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise JudgeError(f"judge at {self.options.url} replied without a finite "
                             f"'{self.options.score_field}': {str(reply)[:200]}")
        return float(value)

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str]) -> list[float]:
        return [self.score_one(o, p) for o, p in zip(outputs, prompts)]
