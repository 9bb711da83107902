"""Stop the local Ray instance a run started when the run's process dies without shutting it down.

``ray.init`` without an address starts Ray's processes (GCS, raylet, agents, workers) as descendants of this
one process. ``ray.shutdown`` stops them, and so does a normal exit. After ``kill -9`` or the OOM killer, the GCS
and the raylet die with their parent, but Ray's agents wait out their own timeout (about 60 s) before they notice.
The watchdog is a small process in a session of its own (a signal to the run's process group does not reach it):
it keeps a list of the run's descendants (pid and start time, so that a reused pid is never taken for one) and,
once the run's process is gone, kills those still alive. Ray's agents and workers rename their process titles, so
they cannot be found by command line afterwards; the list is how. It exits by itself when the session ends
normally (none of Ray's processes left while the run lives on)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from typing import Any

POLL_S = 0.2  # how often the watchdog looks at the run's process
REFRESH_S = 1.0  # how often it lists the run's descendants again
READY_TIMEOUT_S = 30.0  # how long the run waits for the watchdog's first list (then goes on without the wait)


def _identity(proc: Any) -> tuple[int, float] | None:
    try:
        return proc.pid, proc.create_time()
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess / AccessDenied: gone or not ours
        return None


def descendants(root: Any) -> set[tuple[int, float]]:
    """(pid, start time) of every process below ``root`` (a psutil.Process)."""
    try:
        children = root.children(recursive=True)
    except Exception:  # noqa: BLE001 - the root is gone
        return set()
    return {ident for ident in map(_identity, children) if ident is not None}


def kill(known: set[tuple[int, float]]) -> int:
    """Kill the processes of ``known`` that still run (same pid and start time). Returns how many."""
    import psutil

    killed = 0
    for pid, created in known:
        try:
            proc = psutil.Process(pid)
            if proc.create_time() != created:
                continue  # the pid was reused: not ours
            proc.kill()
            killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return killed


def watch(driver: int, created: float, tops: list[int], poll_s: float = POLL_S, refresh_s: float = REFRESH_S,
          ready: Any = None) -> int:
    """Wait for the run's process (``driver``, started at ``created``) to end, then kill what is left of Ray's
    processes: ``tops`` (the children ``ray.init`` started) and everything below them. Returns the number of
    processes killed (0 after a normal shutdown). ``ready()`` is called once the first list is taken."""
    import psutil

    try:
        root = psutil.Process(driver)
        if root.create_time() != created:
            return 0
    except psutil.NoSuchProcess:
        return 0
    heads = [p for p in map(_process, tops) if p is not None]

    def below() -> set[tuple[int, float]]:
        found = {ident for ident in map(_identity, heads) if ident is not None and heads_alive(ident)}
        for head in heads:
            found |= descendants(head)
        return found

    def run_alive() -> bool:
        try:
            return root.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    known = below()
    if ready is not None:
        ready()
    last_refresh = time.monotonic()
    while run_alive():
        time.sleep(poll_s)
        if time.monotonic() - last_refresh >= refresh_s:
            last_refresh = time.monotonic()
            now = below()
            if not now:
                # nothing below the heads: ray.shutdown() ran, if the run lives on; if it died meanwhile (its kill
                # took the GCS and the raylet with it, and the agents went to init), what was listed must go
                if run_alive():
                    return 0
                break
            known |= now
    return kill(known)


def _process(pid: int) -> Any:
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def heads_alive(ident: tuple[int, float]) -> bool:
    import psutil

    try:
        proc = psutil.Process(ident[0])
        return proc.create_time() == ident[1] and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def children() -> set[int]:
    """The pids of this process's direct children (call before ``ray.init``, to pass to ``start``)."""
    try:
        import psutil
    except ImportError:
        return set()
    return {c.pid for c in psutil.Process().children()}


def start(before: set[int]) -> subprocess.Popen[bytes] | None:
    """Start the watchdog for this process right after ``ray.init`` started a local instance; ``before`` is
    ``children()`` from just before it, so that only the processes Ray started are watched. Returns None where
    psutil is missing (Ray installs it; without it Ray's own timeouts apply)."""
    try:
        import psutil
    except ImportError:
        return None
    me = psutil.Process()
    tops = sorted(c.pid for c in me.children() if c.pid not in before)
    if not tops:
        return None
    proc = subprocess.Popen(
        # the file itself in isolated mode (-I: no script directory on the path): the package's import is not needed
        [sys.executable, "-I", os.path.abspath(__file__), str(me.pid), repr(me.create_time()),
         ",".join(map(str, tops))],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
        start_new_session=True)
    # wait (bounded) until it holds its first list of Ray's processes: a run killed right after ray.init, before a
    # slow start of the watchdog (a loaded machine) took that list, would leave them behind
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
    if ready:
        proc.stdout.readline()
    proc.stdout.close()
    return proc


def main(argv: list[str]) -> int:
    def ready() -> None:
        try:
            sys.stdout.write("watching\n")
            sys.stdout.flush()
            sys.stdout.close()
        except OSError:  # the run stopped reading (it timed out waiting): watch anyway
            pass

    watch(int(argv[0]), float(argv[1]), [int(p) for p in argv[2].split(",") if p], ready=ready)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
