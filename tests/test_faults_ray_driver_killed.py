"""``kill -9`` of a run that started its own local Ray instance leaves no Ray process behind (issue 30): Ray's
agents used to wait out a timeout of their own (about 60 s) after the GCS and the raylet died with the driver.
The driver here is a process of its own that starts the instance exactly as ``--executor ray`` does
(``RayExecutor._connect``), runs a task and a long-lived actor, prints its Ray processes and waits to be killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from .ray_local import PREAMBLE

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

SCRIPT = PREAMBLE + textwrap.dedent("""
    @ray.remote
    class Holder:
        def ping(self):
            return 1

    holder = Holder.remote()
    ray.get([holder.ping.remote(), ray.remote(lambda: 1).remote()])
    time.sleep(6)  # the agents are up; the watchdog (listing every 1 s, later on a loaded machine) has listed them
    me = psutil.Process()
    ray_procs = [(c.pid, c.create_time(), c.name()) for c in me.children(recursive=True)
                 if "ray_watchdog" not in " ".join(c.cmdline())]
    print(json.dumps(ray_procs), flush=True)
    time.sleep(600)
""")


def _alive(pid: int, created: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_kill_9_of_the_driver_leaves_no_ray_process_behind():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]
        ray_procs = json.loads(line)
        names = {name for _, _, name in ray_procs}
        # the check saw Ray's servers and the agents that used to linger
        assert {"gcs_server", "raylet"} <= names and any("Agent" in n for n in names), names
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20  # Ray's own timeout was about 60 s
        left = ray_procs
        while time.monotonic() < deadline:
            left = [p for p in ray_procs if _alive(p[0], p[1])]
            if not left:
                break
            time.sleep(0.5)
        assert not left, f"still running 20 s after kill -9 of the driver: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_watchdog_kills_what_it_listed_when_the_run_dies_between_two_looks():
    """The race behind a flaky run of the test above: the run and Ray's servers die together (their parent-death
    signal), the agents go to init; a refresh of the watchdog's list between the kill and its next look at the run
    finds nothing below the servers. That is what ``ray.shutdown()`` looks like too, and the watchdog used to exit
    then, leaving the agents. Here the look at the run is rare (1 s) and the refresh frequent, so the refresh comes
    first."""
    import threading

    from omnirl_core.loop.ray_watchdog import watch

    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    head = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys, time
        agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(agent.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    agent = psutil.Process(int(head.stdout.readline()))
    try:
        listed = threading.Event()
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(watch(
            driver.pid, psutil.Process(driver.pid).create_time(), [head.pid], poll_s=1.0, refresh_s=0.05,
            ready=listed.set)))
        thread.start()
        assert listed.wait(30)
        time.sleep(0.2)  # inside the watchdog's 1 s between looks at the run
        driver.kill()
        head.kill()
        driver.wait(timeout=30)
        head.wait(timeout=30)  # the agent now belongs to init
        thread.join(timeout=30)
        # a SIGKILLed process ends when it is next scheduled: on a loaded machine it still ran just after the kill
        deadline = time.monotonic() + 10
        while _alive(agent.pid, agent.create_time()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert result == [1] and not _alive(agent.pid, agent.create_time()), result
    finally:
        for p in (driver, head):
            if p.poll() is None:
                p.kill()
        if agent.is_running():
            agent.kill()
