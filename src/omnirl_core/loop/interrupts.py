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
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

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
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
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


def interruptible(fn: Callable[[], T], heartbeat: Callable[[float], None] | None = None,
                  every_s: float = 10.0) -> T:
    """``fn()``, computed on a helper thread while the calling (main) thread waits, so that a stop signal's handler
    runs within a fraction of a second even while ``fn`` is inside one long native call. The handler's exception
    (``Interrupted``) leaves the call behind: it finishes on its own and its result is dropped. ``heartbeat(s)`` is
    called every ``every_s`` seconds of waiting with the seconds waited so far (progress of a long call). Off the
    main thread (where no handler runs) ``fn`` runs in place. Thread-local torch state (grad mode) is not carried
    over: ``fn`` sets what it needs."""
    if threading.current_thread() is not threading.main_thread():
        return fn()
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=target, name="omnirl-compute", daemon=True)
    start = last = time.monotonic()
    thread.start()
    try:
        while not done.wait(0.5):  # a signal interrupts the wait and its handler runs here
            now = time.monotonic()
            if heartbeat is not None and now - last >= every_s:
                last = now
                heartbeat(now - start)
    except BaseException:
        if not done.is_set():
            _ABANDONED.append(thread)
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]


def abandoned() -> list[threading.Thread]:
    """Helper threads of ``interruptible`` calls a signal left behind that still compute: the process should end
    without waiting for them (``os._exit`` after flushing its output), not in the interpreter's shutdown, which
    would tear down what they use."""
    return [t for t in _ABANDONED if t.is_alive()]
