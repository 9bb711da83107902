"""Process groups the core forms are destroyed at exit, before the interpreter's finalisation (where gloo's worker
threads aborted a finished rank with SIGABRT, "terminate called without an active exception", now and then)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import atexit, torch.distributed as dist
atexit.register(lambda: print("group alive after omnirl's exit handler:", dist.is_initialized()))  # runs last
from omnirl_core.loop.distributed import ensure_process_group
ensure_process_group("gloo")
print("group formed:", dist.is_initialized(), dist.get_world_size())
"""


def test_a_group_formed_by_the_core_is_destroyed_by_an_exit_handler():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["group formed: True 1", "group alive after omnirl's exit handler: False"]
