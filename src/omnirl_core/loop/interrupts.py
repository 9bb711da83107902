"""Stopping a run cleanly: Ctrl-C (SIGINT) and SIGTERM.

A step has two parts. Before the update (rollout, rewards) the weights are still those of the last
finished step: a signal stops at once, and the run saves that step. From the first optimizer step of the
update to the step's metrics row, the weights are in between two steps: a signal there is deferred until
the step is finished and saved (a second signal stops at once; the update in flight is then dropped and
nothing of it is saved). Either way a checkpoint holds whole steps only.

"At once" needs the main thread to reach Python: a handler runs between bytecodes, so one long native call (a
VAE decode or an attention over a large image, minutes on a CPU) would hold a signal until it returns. A rollout
engine runs such calls through ``interruptible``: on a helper thread, while the main thread waits where a signal
reaches it. A call a signal abandons finishes on its own and its result is dropped (the step it belonged to is not
saved); the process then exits without waiting for it (``abandoned``).
"""

from __future__ import annotations

import logging
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from types import FrameType

T = TypeVar("T")

log = logging.getLogger("omnirl")


class Interrupted(KeyboardInterrupt):
    """A stop signal; ``exit_code`` is 130 for SIGINT and 143 for SIGTERM, as a shell reports them."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


class StopSignals:
    def __init__(self) -> None:
        self.pending: int | None = None
        self._deferring = False
        self._previous: dict[signal.Signals, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._deferring and self.pending is None:
            self.pending = signum
            log.warning("%s: finishing the update in progress, then saving (send it again to stop at once, "
                        "dropping this step)", signal.Signals(signum).name)
            return
        raise Interrupted(signum)

    @contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """Handle SIGINT / SIGTERM while the run goes (only the main thread can)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handler)
        try:
            yield self
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Signals wait until the block ends; then ``raise_pending`` stops the run."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def raise_pending(self) -> None:
        if self.pending is not None:
            raise Interrupted(self.pending)


_ABANDONED: list[threading.Thread] = []


class _Helper:
    """One long-lived daemon thread that computes what ``interruptible`` hands it, one call at a time: its
    OpenMP team (torch's CPU threads) lives as long as it does, where a thread per call would build one per call.
    A call a signal abandons keeps it; the next call gets a new helper."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="omnirl-compute", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            fn, threads, box, done = self.jobs.get()
            try:
                torch = sys.modules.get("torch")
                if torch is not None and threads and torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)  # the caller's count: threads.adapt changes it between steps
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = exc
            finally:
                done.set()


_HELPER: list[_Helper] = []


def interruptible(fn: Callable[[], T], heartbeat: Callable[[float], None] | None = None,
                  every_s: float = 10.0) -> T:
    """``fn()``, computed on a helper thread while the calling (main) thread waits, so that a stop signal's handler
    runs within a fraction of a second even while ``fn`` is inside one long native call. The handler's exception
    (``Interrupted``) leaves the call behind: it finishes on its own and its result is dropped. ``heartbeat(s)`` is
    called every ``every_s`` seconds of waiting with the seconds waited so far (progress of a long call). Off the
    main thread (where no handler runs) ``fn`` runs in place. The helper computes with the caller's torch thread
    count; other thread-local torch state (grad mode, the CUDA device) is not carried over: ``fn`` sets what it
    needs."""
    if threading.current_thread() is not threading.main_thread():
        return fn()
    if not _HELPER:
        _HELPER.append(_Helper())
    helper = _HELPER[0]
    torch = sys.modules.get("torch")
    box: dict[str, Any] = {}
    done = threading.Event()
    start = last = time.monotonic()
    helper.jobs.put((fn, torch.get_num_threads() if torch is not None else None, box, done))
    try:
        while not done.wait(0.5):  # a signal interrupts the wait and its handler runs here
            now = time.monotonic()
            if heartbeat is not None and now - last >= every_s:
                last = now
                heartbeat(now - start)
    except BaseException:
        if not done.is_set():
            _ABANDONED.append(helper.thread)
            _HELPER.clear()  # it stays busy with the abandoned call
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]


def abandoned() -> list[threading.Thread]:
    """Helper threads of ``interruptible`` calls a signal left behind that still compute: the process should end
    without waiting for them (``os._exit`` after flushing its output), not in the interpreter's shutdown, which
    would tear down what they use."""
    return [t for t in _ABANDONED if t.is_alive()]
