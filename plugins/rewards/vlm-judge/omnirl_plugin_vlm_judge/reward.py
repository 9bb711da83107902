"""The ``vlm-judge`` reward: each image and its prompt go to a VLM served with the OpenAI-compatible
chat-completions API (vLLM, SGLang, vllm-omni); the score is parsed from the reply.

One image per request (a base64 PNG data URL in an ``image_url`` content part; JPEG with ``image_format``), preceded
by the prompt's source image for an edit (the ``edit`` template, ``source_image``), ``temperature`` 0. A batch
is judged with up to ``concurrency`` requests in flight. The requests run on one asyncio event loop in a
background thread (an ``aiohttp.ClientSession`` and its connection pool: a C HTTP parser, about a fifth of the
client CPU per request that httpx took, which a remote judge spends on the trainer's cores). Each request is
bounded by a wall-clock deadline by cancelling it - also against a server that trickles its headers or its
body one byte at a time. Callers (any reward thread) get
a plain blocking call; ``submit`` returns the future instead, which the core's Ray async reward actor awaits.

Failures raise :class:`JudgeError` with a one-line message naming the server, never the key; the core's
reward dispatch decides whether that fails the step or drops the reward for the batch. Retried: connection
errors, HTTP 429 and 5xx. Not retried: a missed deadline, a redirect (never followed: the key must not reach
another origin), other statuses, unusable replies.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import ipaddress
import json
import logging
import os
import threading
import urllib.request
import weakref
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import numpy as np

from omnirl_core.contracts import Reward
from omnirl_plugin_vlm_judge.options import VLMJudgeOptions
from omnirl_plugin_vlm_judge.parse import JudgeError, ReplyError, loads, parse_score
from omnirl_plugin_vlm_judge.redaction import Redactor, display_url

log = logging.getLogger("omnirl.rewards.vlm_judge")
ERROR_BODY_BYTES = 4096  # read of a non-200 reply, for the error message
MAX_BACKOFF_S = 30.0
# connection refused or reset, a server gone mid-reply, a connect timeout (a ServerTimeoutError: the only one,
# since reads are bounded by the request's deadline), a broken body
TRANSIENT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)


def chat_completions_url(url: str) -> str:
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if not path.endswith("/chat/completions"):
        path += "/chat/completions"
    return urlunsplit(parts._replace(path=path))


def image_data_url(output: Any, image_format: str = "png", jpeg_quality: int = 95) -> str:
    """(3, H, W) or (H, W, 3) in [0, 1] (a tensor or an array) -> ``data:image/png;base64,...`` (or jpeg)."""
    from PIL import Image

    array = output.detach().cpu().float().numpy() if hasattr(output, "detach") else np.asarray(output)
    if array.ndim != 3 or not (array.shape[0] in (1, 3) or array.shape[-1] in (1, 3)):
        raise JudgeError(f"vlm-judge scores images (3, H, W) or (H, W, 3); got an output of shape {array.shape}")
    if array.shape[0] in (1, 3) and array.shape[-1] not in (1, 3):
        array = np.transpose(array, (1, 2, 0))
    image = Image.fromarray((np.clip(np.nan_to_num(array), 0, 1) * 255).round().astype(np.uint8).squeeze())
    buffer = io.BytesIO()
    if image_format == "jpeg":
        image.save(buffer, format="JPEG", quality=jpeg_quality)
    else:
        image.save(buffer, format="PNG")
    return f"data:image/{image_format};base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def proxy_for(url: str) -> str | None:
    """The proxy the environment sets for ``url`` (``https_proxy`` / ``http_proxy``, else ``all_proxy``; none for a
    host that ``no_proxy`` names), as HTTP clients read it; None for none."""
    parts = urlsplit(url)
    if parts.hostname and urllib.request.proxy_bypass_environment(parts.hostname):
        return None
    proxies = urllib.request.getproxies_environment()
    return proxies.get(parts.scheme) or proxies.get("all") or None


def _one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "…"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _shut(loop: asyncio.AbstractEventLoop, client: aiohttp.ClientSession, thread: threading.Thread) -> None:
    """Close the session on its loop, then stop the loop and its thread."""
    if threading.current_thread() is thread:  # collected on its own loop: close there, then stop
        loop.create_task(client.close()).add_done_callback(lambda _: loop.stop())
        return
    if not loop.is_closed() and thread.is_alive():
        try:
            asyncio.run_coroutine_threadsafe(client.close(), loop).result(timeout=5)
        except Exception as exc:  # noqa: BLE001 - closing is best effort; the loop still stops
            log.debug("vlm-judge: closing the HTTP session failed: %s", exc)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
    if not thread.is_alive():
        loop.close()


class _Transient(Exception):
    """A failure worth retrying; ``retry_after`` is the server's Retry-After in seconds, if any."""

    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.retry_after = retry_after


class VLMJudge(Reward):
    asynchronous = True  # submit: scores on its own threads / event loop

    def __init__(self, options: VLMJudgeOptions | None = None):
        self.options = options or VLMJudgeOptions()
        self.template = self.options.template()
        self.uses_inputs = self.template.source  # the source image is the prompt record's
        self.endpoint = chat_completions_url(self.options.url)
        self.shown_url = display_url(self.endpoint)
        # the key only from the environment, read once; kept out of repr, messages and logs
        self._key = os.environ.get(self.options.api_key_env) or None
        self._redact = Redactor([self._key] if self._key else [])
        parts = urlsplit(self.endpoint)
        if self._key and parts.scheme == "http" and not _is_loopback(parts.hostname or ""):
            log.warning("vlm-judge sends the API key from %s over plain http to %s; use https beyond this machine",
                        self.options.api_key_env, self.shown_url)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        self._proxy: str | None = None
        self._shutdown: weakref.finalize | None = None

    def __repr__(self) -> str:
        key = f"from ${self.options.api_key_env}" if self._key else "none"
        return f"VLMJudge(url={self.shown_url!r}, model={self.options.model!r}, parse={self.options.parse!r}, key={key})"

    def __reduce__(self):  # rebuilt from its options (the key is read again from that environment)
        return (type(self), (self.options,))

    # -- the event loop ----------------------------------------------------------------------
    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="omnirl-vlm-judge", daemon=True)
                thread.start()
                try:
                    self._client = asyncio.run_coroutine_threadsafe(self._session(), loop).result(timeout=30)
                except BaseException:
                    loop.call_soon_threadsafe(loop.stop)
                    thread.join(timeout=5)
                    loop.close()
                    raise
                self._slots = asyncio.Semaphore(self.options.concurrency)
                self._loop, self._thread = loop, thread
                # the session is closed when the judge is, when it is garbage collected, or at the interpreter's
                # exit (nothing else closes a reward): else every run ended with "Unclosed client session"
                self._shutdown = weakref.finalize(self, _shut, loop, self._client, thread)
            return self._loop

    async def _session(self) -> aiohttp.ClientSession:
        """Made on the loop that uses it. Reads have no timeout of their own: ``_attempt``'s deadline bounds the
        whole request. The proxy is read from the environment once, here (``proxy_for``), not per request."""
        opts = self.options
        self._proxy = proxy_for(self.endpoint)
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=opts.concurrency),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(opts.timeout_s, 10.0)),
            headers={"Accept": "application/json", "Accept-Encoding": "identity",
                     "User-Agent": "omnirl-vlm-judge/0.1"},
            auto_decompress=False,
        )

    def close(self) -> None:
        """Close the connections and stop the loop thread (a later call starts them again)."""
        with self._lock:
            shutdown, self._shutdown = self._shutdown, None
            self._loop = self._client = self._thread = self._slots = None
        if shutdown is not None:
            shutdown()

    # -- scoring -----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Images judged at once (``concurrency``): a Ray reward actor's calls carry up to this many."""
        return self.options.concurrency

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str],
                 inputs: Sequence[dict[str, Any]] | None = None) -> list[float]:
        return self.submit(outputs, prompts, inputs).result()

    def submit(self, outputs: Sequence[Any], prompts: Sequence[str],
               inputs: Sequence[dict[str, Any]] | None = None) -> concurrent.futures.Future:
        """Encodes the requests here, then judges them on the judge's own event loop: returns at once, with
        the future of the scores (what a Ray async reward actor awaits: calls overlap without a thread each).
        Cancelling the future cancels the requests."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if len(outputs) != len(prompts):
            future.set_exception(JudgeError(f"vlm-judge got {len(outputs)} outputs but {len(prompts)} prompts"))
            return future
        if not outputs:
            future.set_result([])
            return future
        opts = self.options
        try:
            sources = self._sources(inputs, len(outputs))
        except (ValueError, OSError) as exc:
            future.set_exception(JudgeError(f"vlm-judge sends each edit's source image: {exc}"))
            return future
        bodies = [self.request_body(image_data_url(o, opts.image_format, opts.jpeg_quality), p, s)
                  for o, p, s in zip(outputs, prompts, sources)]
        return asyncio.run_coroutine_threadsafe(self._score_all(bodies), self._start())

    def _sources(self, inputs: Sequence[dict[str, Any]] | None, count: int) -> list[list[str]]:
        """Each sample's source image(s) as data URLs (none unless the template sends them)."""
        if not self.template.source:
            return [[] for _ in range(count)]
        if inputs is None or len(inputs) != count:
            raise ValueError("it was called without the prompts' records (the runtime passes them to a reward that "
                             "uses_inputs)")
        from omnirl_core.rewards_kit.sources import source_images

        opts = self.options
        return [[image_data_url(s, opts.image_format, opts.jpeg_quality) for s in source_images(record)]
                for record in inputs]

    def request_body(self, image_url: str, prompt: str, sources: Sequence[str] = ()) -> bytes:
        """The chat completion: the source image(s) of an edit first, then the sample, then the question."""
        opts = self.options
        body: dict[str, Any] = {
            "model": opts.model,
            "messages": [{"role": "user", "content": [
                *({"type": "image_url", "image_url": {"url": url}} for url in sources),
                {"type": "image_url", "image_url": {"url": image_url}},
                # replace, not format: a custom template may hold JSON braces
                {"type": "text", "text": self.template.text.replace("{prompt}", prompt)},
            ]}],
            "temperature": 0.0,
            "n": 1,
            "max_tokens": opts.max_tokens,
        }
        if opts.parse == "yes-logprob":
            body.update(max_tokens=1, logprobs=True, top_logprobs=opts.top_logprobs)
        return json.dumps(body).encode()

    async def _score_all(self, bodies: list[bytes]) -> list[float]:
        tasks = [asyncio.ensure_future(self._score(body)) for body in bodies]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # the first failure ends the batch: no requests left running
            for task in tasks:
                task.cancel()

    async def _score(self, body: bytes) -> float:
        reply = await self._post(body)
        try:
            return parse_score(reply, self.options.parse, self.template, self.options.score_field)
        except ReplyError as exc:
            raise self._error(f"unusable reply from {self.shown_url}: {exc}. Check that the model follows the "
                              f"prompt template, or change parse / prompt_template") from None

    def _error(self, message: str) -> JudgeError:
        return JudgeError("vlm-judge: " + _one_line(self._redact(message), 600))

    async def _post(self, body: bytes) -> Any:
        opts = self.options
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        attempts = opts.retries + 1
        assert self._slots is not None
        for attempt in range(1, attempts + 1):
            try:
                async with self._slots:
                    return await self._attempt(body, headers)
            except _Transient as exc:
                if attempt == attempts:
                    raise self._error(f"{self.shown_url} failed {attempts} time(s), last: {exc}. Check the "
                                      f"judge server (is it up, overloaded?) or raise retries") from None
                delay = min(opts.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
                if exc.retry_after is not None:
                    delay = max(delay, min(exc.retry_after, MAX_BACKOFF_S))
                log.warning("vlm-judge: %s: %s (attempt %d of %d), retrying in %.2f s", self.shown_url,
                            self._redact(str(exc)), attempt, attempts, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _attempt(self, body: bytes, headers: dict[str, str]) -> Any:
        """One request within the deadline: the decoded JSON reply, or _Transient / JudgeError."""
        timeout = self.options.timeout_s
        try:
            status, reply_headers, data = await asyncio.wait_for(self._exchange(body, headers), timeout)
        except TRANSIENT_ERRORS as exc:  # before TimeoutError: a connect timeout is one too, and is retried
            raise _Transient(f"cannot reach it ({type(exc).__name__}: {exc})") from None
        except asyncio.TimeoutError:
            raise self._error(f"no complete reply from {self.shown_url} within timeout_s={timeout:g} s; "
                              f"check the judge server, or raise timeout_s if it is just slow") from None
        except (aiohttp.ClientError, ValueError) as exc:  # an invalid URL, a reply that is not HTTP
            raise self._error(f"request to {self.shown_url} failed ({type(exc).__name__}: {exc}); check url") \
                from None
        text = data.decode("utf-8", "replace")
        if status == 200:
            if self._redact.found(text):  # a score read from it could be a piece of the key
                raise self._error(f"{self.shown_url} quoted the API key back in its reply; no score is read from "
                                  f"such a reply. Check the server (a proxy or an error page that echoes request "
                                  f"headers?)")
            try:
                return loads(data)
            except (ValueError, UnicodeDecodeError):
                start = _one_line(text[:200], 120)
                raise self._error(f"{self.shown_url} answered with a body that is not JSON ({start!r}); "
                                  f"url must be an OpenAI-compatible API (…/v1)") from None
        if 300 <= status < 400:
            where = display_url(reply_headers.get("location", "(no Location)"))
            raise self._error(f"{self.shown_url} answered HTTP {status}, a redirect to {where}. Redirects are "
                              f"never followed (the API key must not reach another origin): set url to the "
                              f"server's real address")
        if len(data) >= ERROR_BODY_BYTES:  # read up to the limit: a key may be cut in two at its end
            text = self._redact.cut(text)
        text = _one_line(self._redact(text))  # masked before it is shortened, which could cut a key in two
        if status == 429 or 500 <= status < 600:
            retry_after = reply_headers.get("retry-after", "")
            raise _Transient(f"HTTP {status}: {text!r}",
                             float(retry_after) if retry_after.isdigit() else None)
        hint = {401: f"check the key in ${self.options.api_key_env} ({'set' if self._key else 'not set'})",
                403: f"check the key in ${self.options.api_key_env} ({'set' if self._key else 'not set'})",
                404: "check url (the server's …/v1) and model (the name the server serves)"}
        raise self._error(f"{self.shown_url} answered HTTP {status}: {text!r}; "
                          f"{hint.get(status, 'check model, max_tokens and that the model accepts images')}")

    async def _exchange(self, body: bytes, headers: dict[str, str]) -> tuple[int, Any, bytes]:
        """Send; read at most max_response_bytes of a 200 reply (ERROR_BODY_BYTES of another), streamed."""
        assert self._client is not None
        limit = self.options.max_response_bytes
        async with self._client.post(self.endpoint, data=body, headers=headers, allow_redirects=False,
                                     proxy=self._proxy) as response:
            status = response.status
            if 300 <= status < 400:
                return status, response.headers, b""
            declared = response.headers.get("content-length", "")
            if status == 200 and declared.isdigit() and int(declared) > limit:
                raise self._error(f"{self.shown_url} announced a {int(declared)}-byte reply, over "
                                  f"max_response_bytes={limit}; raise max_response_bytes or lower max_tokens")
            cap = limit if status == 200 else ERROR_BODY_BYTES
            chunks, size = [], 0
            async for chunk in response.content.iter_any():
                chunks.append(chunk)
                size += len(chunk)
                if size > cap:
                    if status == 200:
                        raise self._error(f"the reply from {self.shown_url} exceeds max_response_bytes={limit} "
                                          f"(stopped reading); raise max_response_bytes or lower max_tokens")
                    break
            return status, response.headers, b"".join(chunks)[:cap]
