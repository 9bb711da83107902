"""A test plugin: trackers that fail at start ('broken-start') or at every step ('broken-log')."""

from omnirl_core import hookimpl
from omnirl_core.contracts import Tracker
from omnirl_core.registry import TrackerSpec


class BrokenLog(Tracker):
    def __init__(self, options=None):
        self.closed = False

    def start(self, run):
        pass

    def log(self, event):
        raise OSError(f"disk full at step {event.step}")

    def close(self):
        raise RuntimeError("cannot close")


class BrokenStart(BrokenLog):
    def start(self, run):
        raise ModuleNotFoundError("No module named 'nothing_here'")


@hookimpl
def omnirl_register_trackers(register):
    register(TrackerSpec(name="broken-log", factory=BrokenLog))
    register(TrackerSpec(name="broken-start", factory=BrokenStart, requires=("nothing-here",)))
