"""A rollout (or reward) server in a process of its own, usually in an environment of its own
(``omnirl_core.serving.envs``), and the client the trainer's side uses to talk to it.

Transport: HTTP on 127.0.0.1 with a per-process token. Every message, both ways, is one safetensors blob:
the tensors, and the JSON part in the header's ``__metadata__`` under the key ``json``. No pickle crosses
the socket, and the two sides may run different torch versions.

Server side (inside the other environment)::

    def generate(meta: dict, tensors: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]: ...
    serve({"generate": generate, "load_lora": load_lora}, setup=build_engine)

``serve`` reads the port and token from its command line / environment, runs ``setup`` (the slow engine
start), prints one ready line with the port, and handles calls one at a time (engines are not re-entrant).
Client side: ``ServerProcess(python, module, args, env)`` starts it, waits for the ready line, and
``call(name, meta, tensors)`` returns the reply; a server-side exception comes back as ``ServerError`` with
its traceback text.
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import re
import secrets
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.contracts import PolicyModel, RolloutEngine
from omnirl_core.errors import OmnirlError, UsageError

if TYPE_CHECKING:
    import torch

READY = "OMNIRL_SERVER_READY"
_READY_LINE = re.compile(READY + r" port=(\d+)")
TOKEN_ENV = "OMNIRL_SERVER_TOKEN"
HOST = "127.0.0.1"

Handler = Callable[[dict[str, Any], dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]]


class ServerError(OmnirlError):
    """The server raised while handling a call, or died."""


# -- wire format -----------------------------------------------------------------------------------------
def pack(meta: dict[str, Any], tensors: dict[str, Any] | None = None) -> bytes:
    """One safetensors blob: ``tensors`` and ``meta`` as JSON in the header metadata."""
    from safetensors.torch import save

    tensors = {k: v.detach().cpu().contiguous() for k, v in (tensors or {}).items()}
    return save(tensors, metadata={"json": json.dumps(meta)})


def unpack(blob: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    from safetensors.torch import load

    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + size])
    meta = json.loads(header.get("__metadata__", {}).get("json", "{}"))
    return meta, load(blob)


# -- server ------------------------------------------------------------------------------------------------
def serve(handlers: dict[str, Handler], setup: Callable[[], None] | None = None, port: int = 0) -> None:
    """Run a server until it is told to stop (``shutdown`` call, SIGTERM) or its parent dies."""
    token = os.environ.get(TOKEN_ENV, "")
    if setup is not None:
        setup()
    handlers = {**handlers, "ping": lambda meta, tensors: ({"pid": os.getpid()}, {})}
    server: HTTPServer

    class _Handler(BaseHTTPRequestHandler):
        disable_nagle_algorithm = True  # TCP_NODELAY: headers and body are two writes (see reward_server)

        def log_message(self, fmt: str, *args: object) -> None:  # the trainer's log stays clean
            return

        def do_POST(self) -> None:
            if self.headers.get("X-Omnirl-Token", "") != token:
                self.send_error(403, "bad token")
                return
            name = self.path.strip("/")
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if name == "shutdown":
                self._reply(200, pack({"ok": True}))
                threading.Thread(target=server.shutdown, daemon=True).start()
                return
            handler = handlers.get(name)
            if handler is None:
                self._reply(404, pack({"error": f"no call '{name}'; known: {sorted(handlers)}"}))
                return
            try:
                meta, tensors = unpack(body)
                out_meta, out_tensors = handler(meta, tensors)
                self._reply(200, pack(out_meta, out_tensors))
            except Exception as exc:  # noqa: BLE001 - reported to the client with its traceback
                self._reply(500, pack({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}))

        def _reply(self, status: int, blob: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(blob)))
            self.end_headers()
            self.wfile.write(blob)

    server = HTTPServer((HOST, port), _Handler)
    parent = os.getppid()

    def watch_parent() -> None:  # never outlive the trainer
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch_parent, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    # straight to the file descriptor: engines wrap sys.stdout (vLLM prefixes every line with its worker name)
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{READY} port={server.server_address[1]}\n".encode())
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()


# -- client ------------------------------------------------------------------------------------------------
class ServerProcess:
    """A server started in ``python`` (another environment's interpreter) as ``python -m module *args``.

    Its output goes to a log file (``log_path``), shown in errors. ``start_timeout_s`` covers the engine's
    start (minutes for vLLM on a small CPU)."""

    def __init__(self, python: str | Path, module: str, args: list[str] | None = None,
                 env: dict[str, str] | None = None, start_timeout_s: float = 900.0, log_dir: str | Path | None = None,
                 name: str = "rollout server", cwd: str | Path | None = None):
        self.name = name
        self.token = secrets.token_hex(16)
        log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="omnirl-server-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{module.rsplit('.', 1)[-1]}-{os.getpid()}.log"
        full_env = {**os.environ, **(env or {}), TOKEN_ENV: self.token}
        full_env.pop("PYTHONPATH", None)  # the other environment must not import the trainer's packages
        full_env.pop("VIRTUAL_ENV", None)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen([str(python), "-u", "-m", module, *(args or [])], stdout=subprocess.PIPE,
                                     stderr=self._log, env=full_env, start_new_session=True,
                                     cwd=None if cwd is None else str(cwd))
        self.port = self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> int:
        assert self.proc.stdout is not None
        found: list[int] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace")
                self._log.write(raw)
                self._log.flush()
                match = None if found else _READY_LINE.search(line)
                if match:  # anywhere in the line: a wrapped stdout may prefix it
                    found.append(int(match.group(1)))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout_s
        while not found:
            if self.proc.poll() is not None:
                raise ServerError(f"The {self.name} exited during start (exit {self.proc.returncode}).",
                                  details=self.log_tail(), hint=f"Full log: {self.log_path}")
            if time.monotonic() > deadline:
                self.close()
                raise ServerError(f"The {self.name} did not start within {timeout_s:.0f} s.",
                                  details=self.log_tail(), hint=f"Full log: {self.log_path}; raise the start timeout "
                                  "on a slow machine.")
            time.sleep(0.1)
        return found[0]

    def log_tail(self, lines: int = 30) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return []

    def call(self, name: str, meta: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None,
             timeout_s: float | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.proc.poll() is not None:
            raise ServerError(f"The {self.name} is not running (exit {self.proc.returncode}).",
                              details=self.log_tail(), hint=f"Full log: {self.log_path}")
        body = pack(meta or {}, tensors)
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout_s)
        try:
            conn.request("POST", f"/{name}", body=body,
                         headers={"X-Omnirl-Token": self.token, "Content-Type": "application/octet-stream"})
            response = conn.getresponse()
            blob = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise ServerError(f"Call '{name}' to the {self.name} failed: {exc}", details=self.log_tail(),
                              hint=f"Full log: {self.log_path}") from exc
        finally:
            conn.close()
        out_meta, out_tensors = unpack(blob)
        if response.status != 200:
            raise ServerError(f"The {self.name} failed in '{name}': {out_meta.get('error', response.status)}",
                              details=str(out_meta.get("traceback", "")).strip().splitlines()[-12:],
                              hint=f"Full log: {self.log_path}")
        return out_meta, out_tensors

    def close(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self.call("shutdown", timeout_s=5.0)
            except ServerError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the engine's children go too
                self.proc.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ServedEngineOptions(BaseModel):
    """Options every engine that runs in a server process of its own environment has (vllm-omni, vllm)."""

    model_config = ConfigDict(extra="forbid")
    weight_sync: Literal["auto", "full", "none"] = Field(
        "auto", description="How trained weights reach the engine before a rollout: 'auto' (with LoRA what the "
        "adapter changes, else every trained weight), 'full' (every weight, a LoRA merged in), 'none' (never: "
        "the engine keeps the weights it started with)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the engine runs: 'auto' follows the trainer's device; 'cpu' takes its CPU path "
        "(tests, no GPU)."
    )
    start_timeout_s: float = Field(900.0, gt=0, description="Longest wait for the engine to start.")
    request_timeout_s: float = Field(3600.0, gt=0, description="Longest wait for one rollout call.")


_SHARED: dict[tuple, ServerProcess] = {}
_SHARED_LOCK = threading.Lock()


def shared_server(python: str | Path, module: str, args: list[str], env: dict[str, str], start_timeout_s: float,
                  name: str) -> ServerProcess:
    """One server per (interpreter, module, arguments, environment) per process, started on first use and kept
    until the process exits: engine objects that ask for the same engine share one start (minutes for vLLM
    on a small CPU); a server that died is started again."""
    key = (str(python), module, tuple(args), tuple(sorted(env.items())))
    with _SHARED_LOCK:
        server = _SHARED.get(key)
        if server is None or server.proc.poll() is not None:
            server = ServerProcess(python, module, args, env=env, start_timeout_s=start_timeout_s, name=name)
            _SHARED[key] = server
        return server


def close_shared_servers() -> None:
    with _SHARED_LOCK:
        for server in _SHARED.values():
            server.close()
        _SHARED.clear()


atexit.register(close_shared_servers)


def server_args(argv: list[str] | None = None) -> dict[str, Any]:
    """``--key value`` pairs of a server's command line as a dict of JSON values (strings otherwise)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out: dict[str, Any] = {}
    while argv:
        key = argv.pop(0)
        if not key.startswith("--") or not argv:
            raise UsageError(f"bad server argument {key!r}; expected --key value pairs")
        raw = argv.pop(0)
        try:
            out[key[2:].replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            out[key[2:].replace("-", "_")] = raw
    return out


class ServedRolloutEngine(RolloutEngine):
    """Base of rollout engines that run in a server process of their own environment (vllm-omni, vllm): the
    device choice, the environment's interpreter, one shared server, and weight sync when the trained weights
    changed (torch's in-place version counters of the trainable parameters). A subclass sets ``name``,
    ``server_module`` and ``fallback`` (the in-process engine to suggest), calls ``start_served`` with its
    environment and server arguments, and implements ``push_weights``."""

    name = "served"
    server_module = ""
    fallback = ""

    def start_served(self, model: PolicyModel, options: ServedEngineOptions, device: torch.device | str,
                     environment: str) -> None:
        from omnirl_core.serving.envs import component_environment, environment_python

        self.model = model
        self.options = options
        kind = getattr(device, "type", str(device)).split(":")[0]
        self.device_kind = kind if options.device == "auto" else options.device
        if self.device_kind not in ("cpu", "cuda"):
            raise UsageError(f"The {self.name} engine runs on cpu or cuda, not '{self.device_kind}'.",
                             hint=f"Use rollout.engine={self.fallback} on this device.")
        env = component_environment(environment, self.device_kind)
        self.python = environment_python(env)
        self.env_vars = dict(env.env)
        self.args: list[str] = []
        self._server: ServerProcess | None = None
        self._synced_version: tuple[int, ...] | None = self._weights_version()  # the engine loads the files
        self.sync_seconds = 0.0
        self.syncs = 0

    @property
    def server(self) -> ServerProcess:
        if self._server is None or self._server.proc.poll() is not None:
            if self._server is not None or self.syncs:
                self._synced_version = None  # a (re)started engine holds the weights on disk again
            self._server = shared_server(self.python, self.server_module, self.args, self.env_vars,
                                         self.options.start_timeout_s, name=f"{self.name} rollout server")
        return self._server

    def _weights_version(self) -> tuple[int, ...]:
        params = self.model.trainable_parameters()
        return tuple(p._version for p in params)

    def sync_weights(self, force: bool = False) -> dict[str, float]:
        """Push the trained weights to the engine if they changed since the last push (or ``force``)."""
        if self.options.weight_sync == "none":
            return {}
        version = self._weights_version()
        if not force and version == self._synced_version:
            return {}
        start = time.perf_counter()
        state, stats = self.push_weights()
        self._synced_version = version
        seconds = time.perf_counter() - start
        self.sync_seconds += seconds
        self.syncs += 1
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        return {"sync/seconds": seconds, "sync/mib": nbytes / 2**20, **stats}

    def push_weights(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Send the trained weights to ``self.server``; returns (the tensors sent, extra figures)."""
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to do: the shared server lives until the process exits (``close_shared_servers``)."""
