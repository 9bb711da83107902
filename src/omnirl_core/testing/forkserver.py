"""Run the ``omnirl`` console script (or a Python script) for a test without paying Python's imports each time.

A test suite starts ``omnirl`` some two hundred times, and each fresh process spends about 9 of its 12 seconds
importing torch, diffusers and transformers. ``run_omnirl`` hands the command to a *fork server*: a process
started once with the caller's environment, which imports those libraries exactly as the console script would
(the thread policy's environment first, then torch) and forks a child per command. The child is a process of
its own: it changes to the requested directory, writes to its own stdout and stderr, runs the console
script's entry point and exits through the interpreter's normal shutdown, so that signals, exit codes,
``atexit`` handlers, threads and child processes behave as in a fresh process.

What keeps it faithful:
- a server serves only callers whose environment is exactly the one it was started with (what a library reads
  at import time is then what a fresh process would read) and whose ``site-packages`` have not changed since
  it started (a plugin a test installs is seen); anything else starts another server (at most ``MAX_SERVERS``),
  but only once that environment's commands have taken ``START_AFTER_S`` as plain subprocesses: a server's
  imports cost more than a light command (a dry run, a listing), so one-off environments run as before;
- the server imports third-party libraries, the CLI module and the installed plugins' modules (their imports
  only: plugin discovery and registration happen in the child, as in a fresh process; a plugin that fails to
  import is left to the commands that need it);
- the server runs no torch operation, so no OpenMP pool exists when it forks;
- its imported objects are frozen out of the garbage collector's reach (``gc.freeze``) before the first fork: a
  child's collections then skip them instead of walking (and copying, page by page) the whole import graph,
  which cost each command about a second at exit (measured: a usage error 1.39 -> 0.31 s through the server).

``OMNIRL_TEST_FORKSERVER=0`` runs every command as a plain subprocess instead. Used by the test helpers
(``tests/conftest.py``'s ``run_cli``, ``omnirl_core.testing.run_train`` and ``check_reward_rises``); it is test
infrastructure, not part of the product.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

MAX_SERVERS = 3
START_AFTER_S = 10.0  # about what a server's imports take
# set per command in the child; no library reads them at import time (torch.distributed reads the rank variables
# when a process group starts)
RUNTIME_KEYS = ("PYTEST_CURRENT_TEST", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT")
PRELOAD = (
    "omnirl_cli.main",  # first: it sets the thread policy's environment before torch loads, as the script does
    "torch", "numpy", "PIL.Image", "safetensors.torch", "yaml", "peft", "diffusers", "transformers",
    "omnirl_core.loop.controller",
    # what diffusers and transformers import lazily on a model's first load (about 1.7 s a command, measured)
    "diffusers.loaders.single_file_model", "diffusers.models.autoencoders", "diffusers.models.transformers",
    "diffusers.models.unets", "diffusers.models.attention_dispatch", "diffusers.guiders",
    "diffusers.pipelines.pipeline_utils", "transformers.conversion_mapping",
)
"""Imported before the server forks; then the factory modules of the installed models and engines
(``plugin_modules``), which import the model classes a command loads."""


def _warm() -> None:
    """Fill transformers' own memo of checkpoint key conversions (about a thousand regular expressions, compiled on
    the first ``from_pretrained`` of a process: about 1 s a command). Pure Python, no torch operation; every later
    call returns a deep copy of it, as it would in a fresh process after its first load."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("llama")


def omnirl_script() -> Path:
    return Path(sys.executable).with_name("omnirl")


def enabled() -> bool:
    return os.environ.get("OMNIRL_TEST_FORKSERVER", "1") != "0" and hasattr(os, "fork") and sys.platform != "win32"


def run_omnirl(args: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
               timeout: float | None = None, fork: bool | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([omnirl, *args], capture_output=True, text=True)``, through a fork server. ``fork``: True
    always through a server, False never; None: from an environment's second command on."""
    return _run({"kind": "omnirl", "argv": [str(omnirl_script()), *map(str, args)]}, env, cwd, timeout, fork)


def run_script(script: str | Path, args: list[str], *, env: dict[str, str] | None = None,
               cwd: str | Path | None = None, timeout: float | None = None,
               fork: bool | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([python, script, *args], ...)``: the script runs as ``__main__``."""
    return _run({"kind": "script", "argv": [str(script), *map(str, args)]}, env, cwd, timeout, fork)


# -- the caller's side ----------------------------------------------------------------------------

def _command(request: dict[str, Any]) -> list[str]:
    argv = request["argv"]
    return argv if request["kind"] == "omnirl" else [sys.executable, *argv]


def _run(request: dict[str, Any], env: dict[str, str] | None, cwd: str | Path | None,
         timeout: float | None, fork: bool | None) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env)
    cmd = _command(request)
    server, key = None, _key(env)
    if fork is not False and enabled():
        try:
            server = _servers.get(key, env, eager=bool(fork))
        except RuntimeError as exc:  # the command still runs, the slow way
            sys.stderr.write(f"omnirl test fork server unavailable, running a plain subprocess: {exc}\n")
    if server is None:
        start = time.monotonic()
        try:
            return subprocess.run(cmd, capture_output=True, text=True, env=env,
                                  cwd=None if cwd is None else str(cwd), timeout=timeout, check=False,
                                  stdin=subprocess.DEVNULL)
        finally:
            _servers.charge(key, time.monotonic() - start)
    try:
        return server.run(request, env, str(cwd) if cwd is not None else os.getcwd(), timeout, cmd)
    finally:
        _servers.release(server)


class _Server:
    def __init__(self, env: dict[str, str]):
        self.directory = tempfile.mkdtemp(prefix="omnirl-forkserver-")
        self.socket_path = os.path.join(self.directory, "s")
        self.busy = 0
        server_env = {k: v for k, v in env.items() if k not in RUNTIME_KEYS}
        log = open(os.path.join(self.directory, "server.log"), "wb")  # noqa: SIM115 - the server's stderr
        self.proc = subprocess.Popen([sys.executable, "-m", "omnirl_core.testing.forkserver", self.socket_path],
                                     env=server_env, cwd=self.directory, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=log)
        log.close()
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            self.proc.kill()
            detail = Path(self.directory, "server.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the test fork server did not start: {detail}")

    def run(self, request: dict[str, Any], env: dict[str, str], cwd: str, timeout: float | None,
            cmd: list[str]) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="omnirl-run-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            runtime = {k: env.get(k) for k in RUNTIME_KEYS}
            message = {**request, "cwd": cwd, "stdout": out, "stderr": err, "runtime_env": runtime}
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.socket_path)
                conn.sendall(json.dumps(message).encode() + b"\n")
                lines = _Lines(conn)
                pid = json.loads(lines.next())["pid"]
                conn.settimeout(timeout)
                try:
                    line = lines.next()
                except TimeoutError:
                    assert timeout is not None  # no deadline: the socket blocks
                    os.kill(pid, signal.SIGKILL)
                    conn.settimeout(60)
                    lines.next()
                    raise subprocess.TimeoutExpired(cmd, timeout, output=_text(out), stderr=_text(err)) from None
            if not line:
                raise RuntimeError("the test fork server stopped before reporting the command's exit")
            code = json.loads(line)["returncode"]
            return subprocess.CompletedProcess(cmd, code, _text(out), _text(err))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.directory, ignore_errors=True)


class _Lines:
    """Newline-terminated messages from a socket (a timeout leaves what was read in place)."""

    def __init__(self, conn: socket.socket):
        self.conn, self.buffer = conn, b""

    def next(self) -> bytes:
        while b"\n" not in self.buffer:
            chunk = self.conn.recv(65536)
            if not chunk:
                line, self.buffer = self.buffer, b""
                return line
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line + b"\n"


def _text(path: str) -> str:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return ""
    return data.decode("utf-8", errors="replace").replace("\r\n", "\n")


ServerKey = tuple[tuple[tuple[str, str], ...], tuple[tuple[str, float], ...]]
"""What a server must share with a command (``_key``)."""


def _key(env: dict[str, str]) -> ServerKey:
    """What a server must share with a command: the environment (but ``RUNTIME_KEYS``) and the install."""
    return tuple(sorted((k, v) for k, v in env.items() if k not in RUNTIME_KEYS)), _site_state()


def _site_state() -> tuple[tuple[str, float], ...]:
    """The install state a server's imports depend on: the mtime of every site-packages directory (pip adds or
    removes a distribution's directory there)."""
    import site

    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return tuple((d, os.stat(d).st_mtime) for d in dirs if os.path.isdir(d))


class _Servers:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.servers: OrderedDict[ServerKey, _Server] = OrderedDict()
        self.spent: dict[ServerKey, float] = {}

    def charge(self, key: ServerKey, seconds: float) -> None:
        with self.lock:
            self.spent[key] = self.spent.get(key, 0.0) + seconds

    def get(self, key: ServerKey, env: dict[str, str], eager: bool = False) -> _Server | None:
        """The server for ``env``; None (run a plain subprocess) while the environment's plain commands have
        taken less than ``START_AFTER_S``, unless ``eager``."""
        with self.lock:
            if key not in self.servers and not eager and self.spent.get(key, 0.0) < START_AFTER_S:
                return None
            server = self.servers.get(key)
            if server is not None and server.proc.poll() is not None:
                del self.servers[key]
                server = None
            if server is None:
                for old_key, old in list(self.servers.items()):
                    if len(self.servers) < MAX_SERVERS:
                        break
                    if old.busy == 0:  # the least recently used idle one
                        old.stop()
                        del self.servers[old_key]
                server = self.servers[key] = _Server(env)
            self.servers.move_to_end(key)
            server.busy += 1
            return server

    def release(self, server: _Server) -> None:
        with self.lock:
            server.busy -= 1

    def stop(self) -> None:
        with self.lock:
            for server in self.servers.values():
                server.stop()
            self.servers.clear()


_servers = _Servers()
atexit.register(_servers.stop)


# -- the server ---------------------------------------------------------------------------------

def plugin_modules() -> list[str]:
    """The modules of the installed model and engine plugins' factories (``"module:attr"`` specs), found by a plugin
    manager of its own (the process-wide one is left unbuilt: a command builds it from its own environment)."""
    from omnirl_core.plugins import PluginManager

    manager = PluginManager()
    manager.load_entry_points()
    return sorted({spec.factory.partition(":")[0] for kind in ("model", "engine") for spec in manager.registries[kind]
                   if isinstance(spec.factory, str)})


def _preload() -> None:
    import importlib

    try:
        modules = [*PRELOAD, *plugin_modules()]
    except Exception as exc:  # noqa: BLE001 - a broken plugin is reported by the commands that need it
        sys.stderr.write(f"fork server: plugins not listed for preloading: {exc}\n")
        modules = list(PRELOAD)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a command that needs it imports it itself, and fails there
            sys.stderr.write(f"fork server: not preloaded: {name}: {exc}\n")
    try:
        _warm()
    except Exception as exc:  # noqa: BLE001 - only a speed-up: a command computes it itself
        sys.stderr.write(f"fork server: not warmed: {exc}\n")


def serve(socket_path: str) -> dict[str, Any]:
    """The server's loop; returns only in a forked child, with the command it is to run."""
    _preload()
    gc.freeze()  # the imports stay the server's: children neither scan nor copy them when they collect
    assert threading.active_count() == 1, "the fork server must not start threads before it forks"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    parent = os.getppid()
    owners: dict[int, socket.socket] = {}
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for _key, _events in selector.select(timeout=0.05):
            conn, _ = listener.accept()
            try:
                request = json.loads(_Lines(conn).next())
            except (OSError, ValueError):
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                for other in owners.values():
                    other.close()
                conn.close()
                return request
            owners[pid] = conn
            try:
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            except OSError:
                pass
        while owners:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            owner = owners.pop(pid, None)
            if owner is not None:
                try:
                    owner.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                owner.close()
        if os.getppid() != parent:  # the test session is gone
            os._exit(0)


def _become(request: dict[str, Any]) -> None:
    """In the child: the command's directory, streams, argv and runtime environment."""
    os.chdir(request["cwd"])
    for key, value in request["runtime_env"].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(handle, fd)
        os.close(handle)
    os.close(stdin)
    sys.argv = list(request["argv"])
    sys.path[0] = str(Path(sys.argv[0]).resolve().parent)


def _main() -> None:
    request = serve(sys.argv[1])
    _become(request)
    if request["kind"] == "omnirl":
        import re

        from omnirl_cli.main import run

        sys.argv[0] = re.sub(r"(-script\.pyw|\.exe)?$", "", sys.argv[0])  # as the console script does
        run()
        sys.exit()
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    _main()
