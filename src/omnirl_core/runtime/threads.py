"""The thread policy: how many CPU threads omnirl's compute uses, and how idle threads wait.

Sized to the cores this process may actually use: its CPU affinity and, in a container, its cgroup CPU
quota (``os.cpu_count()`` reports the machine's, which oversubscribes a job limited to a few cores).

Idle OpenMP threads (torch's intra-op pool, GNU libgomp) spin for a while before they sleep. On a quiet
machine that keeps small parallel regions fast; on a shared one a spinning thread burns the time slice its
partner needs to reach the barrier, and a step took 20-35x its quiet time (profiled: most samples inside
libgomp's spin loop). Spinning briefly, then sleeping (``GOMP_SPINCOUNT``), keeps the quiet speed and
stops the collapse; see ``benchmarks/end_to_end.py`` for the figures behind the default. Both settings are
read by the OpenMP runtime when it loads, so ``apply_env`` must run before torch is imported (the CLI
calls it first thing; Ray workers and rank processes inherit the environment); a value the user set
in the environment always wins.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_SPINCOUNT = "10000"
"""Spin iterations before an idle libgomp thread sleeps (libgomp's own default: 300000)."""


def available_cpus() -> int:
    """Cores this process may use: its affinity mask, capped by a cgroup CPU quota (v2 or v1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota + 1e-9)))
    return max(1, cpus)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by the cgroup quota (quota / period), or None when unlimited or unknown."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        v1 = root / "cpu" / "cpu.cfs_quota_us"
        if v1.is_file():
            quota_us = int(v1.read_text())
            period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
            return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None
    return None


@dataclass
class ThreadPolicy:
    cpus: int
    """Cores available to this process."""
    intra_op: int
    """torch intra-op threads (the OpenMP pool)."""
    inter_op: int
    """torch inter-op threads."""
    spincount: str
    """GOMP_SPINCOUNT in effect ('' when the OpenMP runtime's own default)."""
    wait_policy: str
    """OMP_WAIT_POLICY in effect ('' when unset)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def apply_env(threads: int | None = None, environ: Any = os.environ) -> None:
    """Before torch loads: the OpenMP thread count and the spin-then-sleep wait, unless already set."""
    environ.setdefault("OMP_NUM_THREADS", str(threads or available_cpus()))
    if "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", DEFAULT_SPINCOUNT)


def ray_assigned_cpus() -> int | None:
    """Inside a Ray actor or task: the CPUs Ray assigned it (rounded down, at least 1); None elsewhere. Ray does
    not pin a worker to cores, so without this every actor would size its pools to the whole machine."""
    import sys

    ray = sys.modules.get("ray")  # never imported here: a process that has not loaded Ray is not a Ray worker
    if ray is None or not ray.is_initialized():
        return None
    try:
        context = ray.get_runtime_context()
        if context.worker.mode != ray.WORKER_MODE:
            return None  # the driver
        cpus = context.get_assigned_resources().get("CPU")
    except Exception:  # noqa: BLE001 - an older or newer Ray without these calls: leave the pools as they are
        return None
    return None if cpus is None else max(1, math.floor(cpus + 1e-9))


def configure(threads: int | None = None) -> ThreadPolicy:
    """Size torch's pools: ``threads`` (``run.threads``), else the CPUs Ray assigned this actor, else every
    available core; never more than available."""
    import torch

    cpus = available_cpus()
    if threads is None:
        assigned = ray_assigned_cpus()
        cpus = min(cpus, assigned) if assigned is not None else cpus
    intra = max(1, min(threads or cpus, cpus)) if threads is None else max(1, threads)
    if torch.get_num_threads() != intra:
        torch.set_num_threads(intra)
    inter = torch.get_num_interop_threads()
    return ThreadPolicy(cpus=cpus, intra_op=intra, inter_op=inter,
                        spincount=os.environ.get("GOMP_SPINCOUNT", ""),
                        wait_policy=os.environ.get("OMP_WAIT_POLICY", ""))
