"""The local Ray instance a run starts (``--executor ray`` without ``--ray-address``) listens on the loopback only
(issue 30): the sockets its processes listen on, read with psutil in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from .ray_local import PREAMBLE

pytest.importorskip("ray")
pytest.importorskip("psutil")

SCRIPT = PREAMBLE + textwrap.dedent("""
    ray.get(ray.remote(lambda: 1).remote())  # a worker process too
    me = psutil.Process()
    names = {p.pid: p.name() for p in me.children(recursive=True)}
    names[me.pid] = "driver"
    seen = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the agents open their ports a little after ray.init returns
        seen = sorted({(names[c.pid], c.laddr.ip) for c in psutil.net_connections(kind="inet")
                       if c.status == psutil.CONN_LISTEN and c.pid in names})
        if {"gcs_server", "raylet"} <= {n for n, _ in seen} and any("RuntimeEnvAgent" in n for n, _ in seen):
            break
        time.sleep(0.5)
    print(json.dumps(seen))
    ray.shutdown()
""")


def test_a_local_ray_instance_listens_on_the_loopback_only():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    listening = json.loads(proc.stdout.strip().splitlines()[-1])
    names = {name for name, _ in listening}
    assert {"gcs_server", "raylet"} <= names, listening  # the check saw Ray's servers
    loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    assert all(ip in loopback for _, ip in listening), listening
