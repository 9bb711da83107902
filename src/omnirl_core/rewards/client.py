"""The reward server's client: sends outputs and prompts to a server started with ``omnirl reward serve NAME``
(``omnirl_core.rewards.server``); the ``remote`` reward plugin registers it.

Wire format: ``omnirl_core.rewards.wire`` (a safetensors body: the outputs' own tensors, bit for bit; scores
back as JSON numbers that read back as the same doubles). The server calls its reward as a run calls it in
process: with the batch of each call here (a call goes in one request, unless the served reward is
``batch_invariant``: then in requests of ``batch_size``, which the server may merge), so a served reward gives
exactly the in-process scores. A connection that fails before an answer, or a server that answers 503 (busy),
is retried (``retries``); a server that stays away fails the call with an error that says how to restart it,
and the run, stopped with its last checkpoint, resumes when rerun.

``submit`` starts a call on the reward's own threads (up to ``concurrency`` requests in flight) and returns its
future: a Ray async reward actor awaits it, so its calls overlap without a thread of the actor's each, and the
driver sends the samples that finish together in one call of up to ``capacity`` (``batch_size``) samples, one
request, which the server batches with the others it has.

A reward that reads records gets the files they name sent along (``send_files``: an edit's source and mask, a
reference voice; the server writes them to a directory of the request's own), so the server needs no disk shared
with the run.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator

from omnirl_core.contracts import Reward
from omnirl_core.errors import UsageError
from omnirl_core.rewards.wire import CONTENT_TYPE, EncodedRequest

TOKEN_ENV = "OMNIRL_REWARD_SERVER_TOKEN"
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s@]*@")


class _QuietRequests(logging.Filter):
    """httpx logs every request at INFO ("HTTP Request: POST .../score 200 OK"): one line per reward call, some
    6,400 in a 200-step run, which buried the messages that matter. This drops those lines for the servers of
    remote rewards (``urls``) and nothing else: httpx's other messages, and its lines about other servers, stay."""

    def __init__(self) -> None:
        super().__init__("omnirl-remote-reward")
        self.urls: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not str(record.msg).startswith("HTTP Request:"):
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) > 1 and str(args[1]).startswith(tuple(self.urls)))


_QUIET = _QuietRequests()


class RemoteOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field("http://127.0.0.1:8700", description="The reward server's base URL (`omnirl reward serve "
                     "NAME --port P` listens on http://127.0.0.1:P).")
    expect: str | None = Field(None, description="The reward the server must be serving (checked at start), "
                               "e.g. 'pickscore'; None: any.")
    timeout_s: float = Field(300.0, gt=0, description="Deadline of one request, in seconds.")
    connect_timeout_s: float = Field(5.0, gt=0, description="Deadline of connecting to the server, in seconds.")
    retries: int = Field(3, ge=0, description="Retries of a request whose connection failed before an answer "
                         "(server restarting, connection reset) or that the server was too busy for (503).")
    retry_wait_s: float = Field(1.0, ge=0, description="Wait before the first retry (doubled for each next one).")
    batch_size: int = Field(64, ge=1, description="Most samples per request to a batch-invariant reward (the "
                            "server merges those requests too); a call to any other reward goes in one request, "
                            "so that it scores the batch it would score in process. Also the most samples the "
                            "driver puts in one call on Ray (capacity).")
    concurrency: int = Field(4, ge=1, description="Requests in flight from one reward instance when it is "
                             "submitted to (a Ray async reward actor's overlapping calls); the server batches "
                             "those that arrive together.")
    send_files: bool = Field(True, description="Send the files the records name (an edit's source and mask, a "
                             "reference voice) with each request of a reward that reads records, so the server "
                             "needs no shared disk; false: the server opens the records' paths itself.")

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not re.match(r"(?i)^https?://[^/?#\s]+", url):
            raise ValueError(f"expected http://HOST:PORT or https://..., got {_safe(url)!r}")
        return url


class RemoteRewardError(RuntimeError):
    pass


# What the reward server's HTTP layer (uvicorn) answers itself, in plain text, before the app sees a request
_NOT_JSON = {
    503: "every connection the server serves at once is taken (its --max-connections), after the retries "
         "(options.retries); lower the calls in flight (options.concurrency, the run's reward workers), or restart "
         "the server with a larger --max-connections",
    400: "the server's HTTP parser refused the request (its request line or headers: malformed, or over 64 KiB "
         "together, or a Content-Length it cannot read); is the client's omnirl the server's version?",
}


def _safe(text: str) -> str:
    return _USERINFO.sub(r"\1***@", text)


class RemoteReward(Reward):
    asynchronous = True  # submit: scores on its own threads / event loop

    uses_inputs = True  # forwarded; the server hands them to its reward only if that reward reads them

    def __init__(self, options: RemoteOptions | None = None):
        import httpx

        self.options = o = options or RemoteOptions()
        self.name = "NAME"  # the served reward's, once the server has said it (in messages until then)
        self.url = o.url.rstrip("/")
        self._lock = threading.Lock()
        self._pool: Any = None  # submit's threads (a RewardPool), started on first use
        token = os.environ.get(TOKEN_ENV)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(headers=headers, follow_redirects=False,
                                   timeout=httpx.Timeout(o.timeout_s, connect=o.connect_timeout_s))
        _QUIET.urls.add(str(httpx.URL(self.url + "/")))
        if _QUIET not in logging.getLogger("httpx").filters:
            logging.getLogger("httpx").addFilter(_QUIET)
        try:
            self.info = self._request("GET", "/health", None, retries=0)
        except RemoteRewardError as exc:
            raise UsageError(
                f"Remote reward: no reward server answers at {_safe(self.url)}.",
                details=[str(exc)],
                hint="Start one (`omnirl reward serve NAME --port P`, in the environment that has the reward) "
                "and set rewards.<i>.options.url=http://HOST:P.",
            ) from None
        if o.expect is not None and self.info.get("reward") != o.expect:
            raise UsageError(
                f"Remote reward: the server at {_safe(self.url)} serves '{self.info.get('reward')}', "
                f"not '{o.expect}'.", hint="Point rewards.<i>.options.url at the right server, or change expect.")
        self.name = str(self.info.get("reward", "?"))
        # the served reward's own batch_invariant: the run may then batch the samples that pile up
        self.batch_invariant = bool(self.info.get("batch_invariant"))
        self.capacity = o.batch_size  # samples one call should carry: one request's worth
        if "max_body_bytes" not in self.info:
            raise UsageError(
                f"Remote reward: the server at {_safe(self.url)} speaks the JSON / PNG wire format of an older "
                "omnirl, which rounds images to 8 bits.",
                hint="Update omnirl where the server runs (the same version as the run's) and restart it.")

    def _request(self, method: str, path: str, body: EncodedRequest | None, retries: int) -> Any:
        import httpx

        wait = self.options.retry_wait_s
        for attempt in range(retries + 1):
            try:
                if body is None:
                    response = self.client.request(method, self.url + path)
                else:  # streamed: the tensors' bytes are sent from the tensors themselves
                    chunks = cast("Iterator[bytes]", body.chunks())  # bytes and memoryviews, which httpx writes alike
                    response = self.client.request(method, self.url + path, content=chunks,
                                                   headers={"Content-Type": CONTENT_TYPE,
                                                            "Content-Length": str(body.length)})
                if response.status_code == 503 and attempt < retries:  # busy: its connections or memory are taken
                    time.sleep(wait)
                    wait *= 2
                    continue
                break
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                if attempt == retries:
                    raise RemoteRewardError(
                        f"reward server {_safe(self.url)} is unreachable after {retries + 1} attempt(s) "
                        f"({type(exc).__name__}: {_safe(str(exc)) or 'connection failed'}). If it stopped, restart "
                        f"it (`omnirl reward serve {self.name} --port P`) and rerun the same "
                        "train command: the run resumes from its last checkpoint.") from None
                time.sleep(wait)
                wait *= 2
            except httpx.TimeoutException as exc:
                raise RemoteRewardError(f"reward server {_safe(self.url)} gave no answer in time "
                                        f"({type(exc).__name__}; options.timeout_s={self.options.timeout_s:g})") from None
        try:
            answer = response.json()
        except ValueError:
            why = _NOT_JSON.get(response.status_code, "an answer that is not the reward server's JSON (is it an "
                                "omnirl reward server?)")
            raise RemoteRewardError(f"reward server {_safe(self.url)} answered {response.status_code} "
                                    f"{response.text[:200]!r}: {why}") from None
        if response.status_code != 200:
            error = answer.get("error") if isinstance(answer, dict) else answer
            raise RemoteRewardError(f"reward server {_safe(self.url)} answered {response.status_code}: {error}")
        return answer

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str],  # type: ignore[override]
                 inputs: Sequence[Any] | None = None) -> list[float]:  # the contract's kwargs: inputs only
        if len(outputs) != len(prompts):
            raise RemoteRewardError(f"{len(outputs)} outputs for {len(prompts)} prompts")
        scores: list[float] = []
        size = self.options.batch_size if self.batch_invariant else max(len(prompts), 1)
        limit = int(self.info["max_body_bytes"])
        for start in range(0, len(prompts), size):
            records = inputs[start:start + size] if inputs is not None and self.info.get("uses_inputs") else None
            files = self._files(records) if records is not None and self.options.send_files else None
            body = EncodedRequest(outputs[start:start + size], prompts[start:start + size], records, files)
            if body.length > limit:
                raise RemoteRewardError(
                    f"a request of {len(prompts[start:start + size])} sample(s) takes {body.length} bytes, over the "
                    f"{limit} bytes the reward server {_safe(self.url)} accepts: start it with a larger "
                    f"--max-body-mb{', or lower batch_size' if self.batch_invariant else ''}")
            answer = self._request("POST", "/score", body, retries=self.options.retries)
            if not isinstance(answer, dict) or not isinstance(answer.get("scores"), list):
                raise RemoteRewardError(f"reward server {_safe(self.url)} answered without a 'scores' list")
            scores += answer["scores"]
        return scores

    @staticmethod
    def _files(records: Sequence[Any]) -> dict[str, bytes]:
        """The bytes of every file the records' media fields name, each once."""
        from omnirl_core.contracts.data import media_paths

        files: dict[str, bytes] = {}
        for record in records:
            for path in media_paths(record if isinstance(record, dict) else None):
                if path not in files:
                    try:
                        files[path] = Path(path).read_bytes()
                    except OSError as exc:
                        raise RemoteRewardError(f"cannot send {path} to the reward server: {exc.strerror or exc} "
                                                "(a file the prompt's record names)") from None
        return files

    def submit(self, outputs: Sequence[Any], prompts: Sequence[str],
               inputs: Sequence[Any] | None = None) -> concurrent.futures.Future:
        """Starts the call on this reward's own threads (``concurrency`` at most: further calls queue) and returns
        its future at once."""
        with self._lock:
            if self._pool is None:  # daemon threads: a request still in flight never holds up the exit
                from omnirl_core.rewards.dispatch import RewardPool

                self._pool = RewardPool(self.options.concurrency, name="omnirl-remote-reward")
            return self._pool.submit(self, list(outputs), list(prompts), None if inputs is None else list(inputs))

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(timeout_s=0.0)
        self.client.close()
