"""Stopping a run cleanly: Ctrl-C (SIGINT) and SIGTERM.

A step has two parts. Before the update (rollout, rewards) the weights are still those of the last
finished step: a signal stops at once, and the run saves that step. From the first optimizer step of the
update to the step's metrics row, the weights are in between two steps: a signal there is deferred until
the step is finished and saved (a second signal stops at once; the update in flight is then dropped and
nothing of it is saved). Either way a checkpoint holds whole steps only.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

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
