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

By default (``run.threads: adaptive``) the pool also follows the load: at each step boundary (before the
rollout; a step's rollout and update run on the same pool) a ``ThreadGovernor`` reads how long this process's
threads waited for a CPU while they were runnable (the kernel's per-thread schedstat) and gives up a torch thread
while they wait much of the time, taking it back once they stop waiting; and where this process sees the whole
machine, it never keeps more threads than the cores other processes' runnable tasks leave right then (one busy
process on two cores: one thread), and takes one back at once when no other process has a runnable task (the load
has gone). Where it sees only part of the machine (an affinity mask, a cgroup quota), other processes' load is seen
through its effect on us alone, the wait. On a quiet machine the pool stays at its full size. Under a competing load
of one busy thread per core a fixed pool's step took 2.2-3.4x its quiet time on 2 cores (barriers wait for a thread
the scheduler has taken off its core), the adaptive one 1.7-2.1x; beside one busy process on 2 cores, 1 thread
beat 2 (``benchmarks/README.md``, reference_trainer).

What it costs: floating-point reductions split over threads, so where the thread count changes a sum's order
the numbers change with the load (in the last bits, then through training). Whether they do depends on the
model and the batch shape: at their default batch the tiny presets of Qwen-Image, SD3.5, FLUX, Wan2.2 and
Qwen3-Omni train bit-identically on 1 and 2 threads, BAGEL's does not, and with 2 prompts x 4 samples neither
Qwen-Image's nor SD3.5's does (``benchmarks/thread_invariance.py``). A fixed count
(``run.threads: N``, or ``fixed`` for every available core) keeps a run reproducible bit for bit on any load;
the governor says when it first gives up a thread, and every step's row records the pool it ran on
(``threads/torch``) and the wait share that set it (``threads/wait_share``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("omnirl")

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


def own_schedstat(task_dir: Path = Path("/proc/self/task")) -> dict[str, tuple[int, int]]:
    """Per thread of this process: (ns on a CPU, ns runnable but waiting for one), from
    ``/proc/self/task/<tid>/schedstat``; empty where the kernel does not expose it."""
    out: dict[str, tuple[int, int]] = {}
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return out
    for tid in tids:
        try:
            run, wait = (task_dir / tid / "schedstat").read_text().split()[:2]
            out[tid] = (int(run), int(wait))
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return out


def others_runnable(reads: int = 3, gap_s: float = 0.001, loadavg: Path = Path("/proc/loadavg"),
                    task_dir: Path = Path("/proc/self/task")) -> int | None:
    """How many of other processes' tasks are running or waiting for a CPU right now: the kernel's count of
    runnable tasks (``/proc/loadavg``) less this process's own. While it sees any, it reads again, ``reads`` times
    ``gap_s`` apart, and gives the fewest (a burst of some daemon passes; a busy process stays); a quiet machine
    costs one read. Machine-wide, so None where this process does not see the whole machine (an affinity mask or a
    cgroup quota: the others may run on CPUs it does not use), or where it cannot be read."""
    if available_cpus() != (os.cpu_count() or 1):
        return None
    fewest: int | None = None
    for i in range(reads):
        if i:
            time.sleep(gap_s)
        try:
            running = int(loadavg.read_text().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return None
        others = running - 1  # the reading thread is one of them
        if others > 0:  # maybe: less the other threads of ours that run now
            mine = 0
            try:
                for tid in os.listdir(task_dir):
                    try:
                        stat = (task_dir / tid / "stat").read_text()
                    except OSError:
                        continue  # the thread ended meanwhile
                    mine += stat[stat.rindex(")") + 2:].startswith("R")
            except OSError:
                return None
            others = running - max(mine, 1)
        fewest = others if fewest is None else min(fewest, others)
        if fewest <= 0:
            break
    return max(0, fewest or 0)


def cpus_taken(cpus: int | None = None, **probe: Any) -> bool | None:
    """Whether other processes' tasks alone, running or waiting for a CPU right now, fill ``cpus`` CPUs (default:
    every core of the machine); ``others_runnable`` (its arguments) counts them; None where it cannot."""
    cpus = cpus or available_cpus()
    others = others_runnable(**probe)
    return None if others is None else others >= cpus


class ThreadGovernor:
    """``run.threads: adaptive``: between steps, the torch intra-op pool sized to the cores this process gets.

    ``observe()`` (before a step's rollout) takes the share of the last step's runnable time that this
    process's threads spent waiting for a CPU: above ``drop_above`` it gives up a thread (never below 1), below
    ``raise_below`` for ``patience`` steps in a row it takes one back (never above ``ceiling``). A thread taken
    back that makes the wait jump again at once doubles the patience (up to 32 steps), so a load that leaves
    room for some but not all threads does not flip the count every step. Steps with less than
    ``min_cpu_s`` of CPU time are added to the next one. It also looks at the machine right now (``probe``,
    ``others_runnable``): the cores other processes' runnable tasks leave (``room``: the machine's cores, not just
    the ``ceiling``, less those tasks; other ranks of the run count among them and compute on the rest) cap the
    pool, so it never runs more threads than there are cores left: where the pool is larger it shrinks to the room
    at once, and it takes no thread back beyond it. A load that began between two steps is answered at the first
    step it loads, not one step later, and a partial load (one busy process on two cores) is answered too: beside
    it a 2-thread pool's barriers wait for a thread the scheduler has taken off its core, and one thread was faster
    (``benchmarks/README.md``, reference_trainer). When no other process has a runnable task, a thread it gave up
    comes back at once (unless taking one back has just made the wait return: the patience above), so the first
    step after a load has gone runs on the threads it regained, not on the loaded step's count. The first time it
    gives up a thread it says so (once per process), with the fixed count that keeps a run reproducible bit for
    bit."""

    def __init__(self, ceiling: int, *, drop_above: float = 0.25, raise_below: float = 0.05, min_cpu_s: float = 0.05,
                 sample: Callable[[], dict[str, tuple[int, int]]] = own_schedstat,
                 apply: Callable[[int], None] | None = None, probe: Callable[[], int | None] = others_runnable,
                 machine_cpus: int | None = None):
        self.ceiling = self.threads = max(1, ceiling)
        self.drop_above, self.raise_below, self.min_ns = drop_above, raise_below, int(min_cpu_s * 1e9)
        self.sample = sample
        self.apply = apply if apply is not None else _set_torch_threads
        self.probe = probe
        self.machine_cpus = machine_cpus or os.cpu_count() or 1
        self.patience, self._quiet, self._just_raised = 1, 0, False
        self._told = False
        self.wait_share = 0.0
        """The last observed share of runnable time spent waiting."""
        self.cpus_taken = False
        """At the last observation, other processes' runnable tasks filled every core (``probe``)."""
        self.room: int | None = None
        """At the last observation, the cores other processes' runnable tasks left (at least 1; ``probe``); None
        where the probe cannot see the machine."""
        self.machine_free = False
        """At the last observation, no other process had a runnable task (``probe``)."""
        self._last = sample()

    def observe(self) -> int:
        others = self.probe() if self.ceiling > 1 else None
        self.cpus_taken = others is not None and others >= self.machine_cpus
        self.machine_free = others == 0
        self.room = None if others is None else max(1, self.machine_cpus - others)
        crowded = self.room is not None and self.threads > self.room  # more threads than cores left right now
        now = self.sample()
        run = wait = 0
        for tid, (r, w) in now.items():
            r0, w0 = self._last.get(tid, (0, 0))
            run, wait = run + max(0, r - r0), wait + max(0, w - w0)
        if run < self.min_ns:  # too little to judge the wait: keep counting from the same start
            if crowded:
                self._drop(by_probe=True)
                self._just_raised = False
                self.apply(self.threads)
            return self.threads
        self._last = now
        self.wait_share = share = wait / (run + wait)
        fits = self.room is None or self.threads < self.room  # one more thread would have a core of its own
        raised = False
        if (share > self.drop_above or crowded) and self.threads > 1:
            self._drop(by_probe=crowded and share <= self.drop_above)
        elif self.machine_free and self.threads < self.ceiling and self.patience == 1:
            self.threads += 1  # the load has gone (the last step's wait is the load's): no quiet step to wait for
            self._quiet = 0
            raised = True
        elif share < self.raise_below and self.threads < self.ceiling and fits:
            self._quiet += 1
            if self._quiet >= self.patience:
                self.threads += 1
                self._quiet = 0
                raised = True
        elif share >= self.raise_below or not fits:
            self._quiet = 0
        if self.threads == self.ceiling and share < self.raise_below and not raised:
            self.patience = 1  # back at full size and quiet: the load has gone
        self._just_raised = raised
        self.apply(self.threads)
        return self.threads

    def _drop(self, by_probe: bool) -> None:
        if self._just_raised:
            self.patience = min(2 * self.patience, 32)
        # by the probe: straight to the cores left (a large machine's load takes many at once); by the wait: one
        self.threads = max(1, min(self.threads - 1, self.room)) if by_probe and self.room else self.threads - 1
        self._quiet = 0
        if not self._told:
            self._told = True
            why = ("other processes' tasks fill every CPU of the machine" if by_probe and self.cpus_taken else
                   f"other processes' runnable tasks leave {self.room} of the machine's {self.machine_cpus} CPUs"
                   if by_probe else
                   f"this process's threads waited for a CPU {100 * self.wait_share:.0f}% of the time they were "
                   "runnable")
            log.warning("the CPUs are shared: %s, so torch now computes on %d thread(s) instead of %d (run.threads: "
                        "adaptive, the default; the count follows the load, and the numbers with it in the last "
                        "bits). For a run reproducible bit for bit, fix it: --set run.threads=%d",
                        why, self.threads, self.ceiling, self.ceiling)


def _set_torch_threads(n: int) -> None:
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


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
    adaptive: bool = False
    """``run.threads: adaptive`` (the default): ``intra_op`` is the ceiling a ``ThreadGovernor`` moves under."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def apply_env(threads: int | None = None, environ: MutableMapping[str, str] = os.environ,
              gnu_openmp: bool | None = None) -> None:
    """Before torch loads: the OpenMP thread count and the spin-then-sleep wait, unless already set.

    With GNU libgomp (torch's Linux wheels) also ``OMP_WAIT_POLICY=ACTIVE``: with ``GOMP_SPINCOUNT`` given, libgomp's
    wait policy changes only how long a thread spins while the process holds more OpenMP threads than it has cores
    (1000 iterations instead of 100). It does hold more as soon as a second thread runs torch (the rollout's
    interruptible calls run on a helper thread, whose OpenMP team adds to the main thread's): at 100 the main job's
    update took 0.21 s a step, at 1000 0.11-0.14 s, the same numbers (``benchmarks/README.md``). Other OpenMP
    runtimes (LLVM's libomp, Intel's) read ``ACTIVE`` as spin without end, so it is set for libgomp only."""
    environ.setdefault("OMP_NUM_THREADS", str(threads or available_cpus()))
    if "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", DEFAULT_SPINCOUNT)
        if gnu_openmp if gnu_openmp is not None else torch_uses_libgomp():
            environ["OMP_WAIT_POLICY"] = "ACTIVE"


def torch_uses_libgomp() -> bool:
    """Whether the installed torch ships GNU libgomp (found on disk: torch is not imported)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    root = Path(next(iter(spec.submodule_search_locations)))
    return any(any(d.glob("libgomp*.so*")) for d in (root / "lib", root.parent / "torch.libs") if d.is_dir())


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


def env_threads(environ: Mapping[str, str] = os.environ) -> int | None:
    """The thread count ``OMP_NUM_THREADS`` asks for (its first level, as OpenMP reads a list), or None."""
    value = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def configure(threads: int | str | None = "adaptive") -> ThreadPolicy:
    """Size torch's pools: ``threads`` (``run.threads``: a count), else the CPUs Ray assigned this actor, else
    ``OMP_NUM_THREADS`` when the user set it, else every available core; never more than available.
    ``adaptive`` (the default; also None): that size, as the ceiling of a ``ThreadGovernor``
    (``governor(policy)``); ``fixed``: that size, always."""
    import torch

    adaptive = threads in ("adaptive", None)
    if threads in ("adaptive", "fixed"):
        threads = None
    assert threads is None or isinstance(threads, int)
    cpus = available_cpus()
    if threads is None:
        assigned = ray_assigned_cpus()
        asked = env_threads()  # the user's, or ``apply_env``'s: the available count, the same as unset
        if assigned is not None:
            cpus = min(cpus, assigned)
        elif asked is not None:
            cpus = min(cpus, asked)
    intra = max(1, min(threads or cpus, cpus)) if threads is None else max(1, threads)
    if torch.get_num_threads() != intra:
        torch.set_num_threads(intra)
    inter = torch.get_num_interop_threads()
    return ThreadPolicy(cpus=cpus, intra_op=intra, inter_op=inter,
                        spincount=os.environ.get("GOMP_SPINCOUNT", ""),
                        wait_policy=os.environ.get("OMP_WAIT_POLICY", ""), adaptive=adaptive)


def governor(policy: ThreadPolicy) -> ThreadGovernor | None:
    """The policy's governor (``run.threads: adaptive``, the default), or None for a fixed pool."""
    return ThreadGovernor(policy.intra_op) if policy.adaptive else None
