"""The thread policy: the cores a process may use (affinity, cgroup quota) and the OpenMP wait setting,
applied before torch loads and never over what the user set."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from omnirl_core.host import threads


def test_cgroup_quotas_v2_and_v1(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpu_quota(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpu_quota(v1) == 3.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cgroup_cpu_quota(v1) is None
    assert threads.cgroup_cpu_quota(tmp_path / "missing") is None


def test_available_cpus_follow_the_affinity_and_the_quota(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda root=None: None)
    assert threads.available_cpus() == 4
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda root=None: 2.5)
    assert threads.available_cpus() == 2  # a quota of 2.5 CPUs runs 2 busy threads without throttling
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda root=None: 0.5)
    assert threads.available_cpus() == 1


def test_apply_env_sets_defaults_and_keeps_what_the_user_set():
    env: dict[str, str] = {}
    threads.apply_env(3, env, gnu_openmp=False)
    assert env == {"OMP_NUM_THREADS": "3", "GOMP_SPINCOUNT": threads.DEFAULT_SPINCOUNT}
    env = {}
    threads.apply_env(3, env, gnu_openmp=True)  # libgomp: a longer spin while more threads than cores
    assert env == {"OMP_NUM_THREADS": "3", "GOMP_SPINCOUNT": threads.DEFAULT_SPINCOUNT, "OMP_WAIT_POLICY": "ACTIVE"}
    env = {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "5"}
    threads.apply_env(3, env, gnu_openmp=True)
    assert env == {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "5", "OMP_WAIT_POLICY": "ACTIVE"}
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    threads.apply_env(None, env, gnu_openmp=True)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env  # the user's wait policy decides
    assert threads.torch_uses_libgomp() or not sys.platform.startswith("linux")  # torch's Linux wheels ship it


def test_the_cli_applies_the_policy_before_torch_loads():
    code = ("import os, sys; import omnirl_cli.main; "
            "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    policy = "ACTIVE" if threads.torch_uses_libgomp() else "None"
    assert out.stdout.split() == [threads.DEFAULT_SPINCOUNT, policy, "False"]


def test_configure_sizes_torch_and_reports_the_policy(monkeypatch):
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        policy = threads.configure(1)
        assert torch.get_num_threads() == 1 and policy.intra_op == 1 and policy.cpus >= 1
        assert set(policy.as_dict()) == {"cpus", "intra_op", "inter_op", "spincount", "wait_policy", "adaptive"}
        assert not policy.adaptive and threads.governor(policy) is None
        fixed = threads.configure("fixed")
        assert not fixed.adaptive and fixed.intra_op == threads.available_cpus() and threads.governor(fixed) is None
        for default in (threads.configure(), threads.configure("adaptive"), threads.configure(None)):
            assert default.adaptive and default.intra_op == threads.available_cpus()
            assert threads.governor(default).ceiling == default.intra_op
    finally:
        torch.set_num_threads(before)


def test_omp_num_threads_set_by_the_user_sizes_the_pool_unless_run_threads_does(monkeypatch):
    import torch

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert threads.configure().intra_op == 1 and torch.get_num_threads() == 1
        assert threads.configure("adaptive").intra_op == 1
        assert threads.configure(2).intra_op == 2  # run.threads wins
        monkeypatch.setenv("OMP_NUM_THREADS", "4096,2")  # never more than the available cores
        assert threads.configure().intra_op == threads.available_cpus()
        for unusable in ("", "0", "many"):
            monkeypatch.setenv("OMP_NUM_THREADS", unusable)
            assert threads.configure().intra_op == threads.available_cpus()
    finally:
        torch.set_num_threads(before)


class _Clock:
    """Scripted schedstat samples: each phase adds (CPU seconds, seconds waiting for a CPU) to one thread."""

    def __init__(self):
        self.run = self.wait = 0

    def phase(self, cpu_s: float, wait_s: float) -> None:
        self.run += int(cpu_s * 1e9)
        self.wait += int(wait_s * 1e9)

    def __call__(self) -> dict[str, tuple[int, int]]:
        return {"1": (self.run, self.wait)}


def _governor(ceiling: int = 4, machine_cpus: int | None = None):
    clock, applied = _Clock(), []
    gov = threads.ThreadGovernor(ceiling, sample=clock, apply=applied.append, probe=lambda: gov.others,
                                 machine_cpus=machine_cpus or 2 * ceiling)
    # scripted: other processes' runnable tasks at the next observation (1: on a machine of twice the ceiling's
    # cores they leave room for the whole pool and do not leave the machine free; machine_cpus: they fill it;
    # 0: none)
    gov.others = 1
    return gov, clock, applied


def test_governor_gives_up_threads_while_they_wait_and_takes_them_back_when_quiet():
    gov, clock, applied = _governor(4)
    for expected in (3, 2, 1, 1):  # waiting half the time: one thread fewer per phase, never below 1
        clock.phase(1.0, 1.0)
        assert gov.observe() == expected and gov.wait_share == 0.5
    clock.phase(1.0, 0.1)  # between the thresholds: hold
    assert gov.observe() == 1
    for expected in (2, 3, 4, 4):  # quiet: one back per phase (patience 1), never above the ceiling
        clock.phase(1.0, 0.0)
        assert gov.observe() == expected
    assert applied == [3, 2, 1, 1, 1, 2, 3, 4, 4]


def test_governor_backs_off_when_a_thread_taken_back_makes_the_wait_return():
    """A load that leaves room for 1 of 2 threads: each raise is undone at once, and the wait before the next
    raise doubles (1, 2, 4 quiet phases), instead of flipping every phase."""
    gov, clock, _ = _governor(2)
    counts = []
    for _ in range(14):
        clock.phase(1.0, 0.5 if gov.threads == 2 else 0.0)  # two threads wait, one runs freely
        counts.append(gov.observe())
    assert counts == [1, 2, 1, 1, 2, 1, 1, 1, 1, 2, 1, 1, 1, 1]
    assert gov.patience == 8


def test_governor_says_once_when_it_first_gives_up_a_thread(caplog):
    gov, clock, _ = _governor(4)
    with caplog.at_level("WARNING", logger="omnirl"):
        for _ in range(3):
            clock.phase(1.0, 1.0)
            gov.observe()
    said = [r.getMessage() for r in caplog.records if r.name == "omnirl"]
    assert len(said) == 1 and gov.threads == 1
    assert "50%" in said[0] and "3 thread(s) instead of 4" in said[0] and "--set run.threads=4" in said[0]


def test_governor_adds_short_phases_to_the_next():
    gov, clock, _ = _governor(2)
    clock.phase(0.01, 0.01)  # 10 ms of CPU: too little to judge
    assert gov.observe() == 2 and gov.wait_share == 0.0
    clock.phase(0.09, 0.09)
    assert gov.observe() == 1 and abs(gov.wait_share - 0.5) < 1e-9


def test_governor_gives_up_a_thread_at_once_when_other_processes_fill_every_core():
    """A load that began between two steps: the last step's wait says nothing yet, the machine does."""
    gov, clock, applied = _governor(2)
    clock.phase(1.0, 0.0)
    assert gov.observe() == 2 and not gov.cpus_taken
    gov.others = gov.machine_cpus
    clock.phase(1.0, 0.0)  # a quiet last step, but the cores are taken now
    assert gov.observe() == 1 and gov.cpus_taken
    clock.phase(1.0, 0.0)  # quiet on one thread (the other core is ours alone): no thread back while taken
    assert gov.observe() == 1
    gov.others = 1
    clock.phase(1.0, 0.0)
    assert gov.observe() == 2  # the load has gone
    assert applied == [2, 1, 1, 2]
    gov.others = gov.machine_cpus
    clock.phase(0.01, 0.0)  # too short a step to judge the wait: the machine still counts
    assert gov.observe() == 1


def test_governor_takes_a_thread_back_at_once_when_no_other_process_runs():
    """The first step after a load has gone runs on the threads given up for it, unless a thread taken back has
    just made the wait return (then the patience: quiet steps first)."""
    gov, clock, applied = _governor(2)
    clock.phase(1.0, 1.0)  # loaded
    assert gov.observe() == 1
    clock.phase(1.0, 0.5)  # still loaded, on one thread
    assert gov.observe() == 1 and not gov.machine_free
    gov.others = 0  # the load ended between two steps: the last step's wait is still the load's
    clock.phase(1.0, 0.5)
    assert gov.observe() == 2 and gov.machine_free
    clock.phase(1.0, 0.5)  # it was back: the thread taken back waits again
    assert gov.observe() == 1 and gov.patience == 2
    clock.phase(1.0, 0.5)
    assert gov.observe() == 1  # free right now again, but the last one taken back was undone
    for expected in (1, 2):  # two quiet steps (the patience), then it comes back
        clock.phase(1.0, 0.0)
        assert gov.observe() == expected
    assert applied == [1, 1, 2, 1, 1, 1, 2]


def test_governor_leaves_the_cores_a_partial_load_takes():
    """One busy process on two cores: the pool shrinks to the core it leaves at once, takes no thread back while
    the process stays (the one thread has its own core, so it never waits: the wait alone would take the thread
    back every few steps), and takes it back when the process has gone."""
    gov, clock, applied = _governor(2, machine_cpus=2)
    gov.others = 0
    clock.phase(1.0, 0.0)
    assert gov.observe() == 2 and gov.room == 2
    gov.others = 1
    for _ in range(6):
        clock.phase(1.0, 0.0)
        assert gov.observe() == 1 and gov.room == 1 and not gov.cpus_taken
    gov.others = 0
    clock.phase(1.0, 0.0)
    assert gov.observe() == 2
    assert applied == [2, 1, 1, 1, 1, 1, 1, 2]


def test_governor_shrinks_to_the_room_at_once_on_a_large_machine(caplog):
    gov, clock, _ = _governor(8, machine_cpus=8)
    gov.others = 6
    with caplog.at_level("WARNING", logger="omnirl"):
        clock.phase(1.0, 0.0)
        assert gov.observe() == 2
    said = [r.getMessage() for r in caplog.records if r.name == "omnirl"]
    assert len(said) == 1 and "leave 2 of the machine's 8 CPUs" in said[0] and "2 thread(s) instead of 8" in said[0]
    gov.others = 5  # room for one more: it comes back after a quiet step
    clock.phase(1.0, 0.0)
    assert gov.observe() == 3
    clock.phase(1.0, 0.0)
    assert gov.observe() == 3  # no room for a fourth


def test_governor_says_why_when_the_machine_made_it_give_up_a_thread(caplog):
    gov, clock, _ = _governor(2)
    gov.others = gov.machine_cpus
    with caplog.at_level("WARNING", logger="omnirl"):
        clock.phase(1.0, 0.0)
        gov.observe()
    said = [r.getMessage() for r in caplog.records if r.name == "omnirl"]
    assert len(said) == 1 and "other processes' tasks fill every CPU of the machine" in said[0]
    assert "1 thread(s) instead of 2" in said[0] and "--set run.threads=2" in said[0]


def test_cpus_taken_counts_other_processes_runnable_tasks(tmp_path):
    """From /proc/loadavg's runnable count less this process's running threads (files written here)."""
    tasks = tmp_path / "task"
    for tid, state in (("10", "R"), ("11", "S"), ("12", "R")):  # two of ours running
        (tasks / tid).mkdir(parents=True)
        (tasks / tid / "stat").write_text(f"{tid} (py thread (x)) {state} 1 2 3")
    loadavg = tmp_path / "loadavg"

    def taken(running: int, cpus: int = 2):
        loadavg.write_text(f"1.00 0.50 0.20 {running}/80 1234\n")
        return threads.cpus_taken(cpus, gap_s=0.0, loadavg=loadavg, task_dir=tasks)

    if threads.available_cpus() != (os.cpu_count() or 1):  # a part of the machine: not judged from machine-wide counts
        assert taken(9) is None
        return
    assert taken(1) is False and taken(2) is False  # the reader alone; one other task
    assert taken(3) is False  # 3 runnable, 2 of them ours: one other
    assert taken(4) is True  # two others fill both cores
    assert taken(5, cpus=4) is False
    counts = []
    for running in (1, 2, 3, 4, 6):
        loadavg.write_text(f"1.00 0.50 0.20 {running}/80 1234\n")
        counts.append(threads.others_runnable(gap_s=0.0, loadavg=loadavg, task_dir=tasks))
    assert counts == [0, 0, 1, 2, 4]  # the reader; then the others, less our running threads
    loadavg.write_text("garbage")
    assert threads.cpus_taken(2, loadavg=loadavg, task_dir=tasks) is None


def test_cpus_taken_sees_a_real_competing_load():
    cpus = threads.available_cpus()
    if threads.cpus_taken(cpus) is None:
        return  # this process sees a part of the machine only
    busy = [subprocess.Popen([sys.executable, "-c", "while True:\n    pass"]) for _ in range(cpus)]
    try:
        deadline = time.monotonic() + 20.0
        while not threads.cpus_taken(cpus) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert threads.cpus_taken(cpus), f"{cpus} busy processes not seen"
    finally:
        for p in busy:
            p.kill()
            p.wait()


def test_own_schedstat_reads_this_process_threads():
    sample = threads.own_schedstat()
    if not sample:  # a kernel without schedstat: the governor then never sees a wait and keeps the ceiling
        return
    assert str(threading.get_native_id()) in sample
    sum(i * i for i in range(200_000))  # some CPU time
    again = threads.own_schedstat()[str(threading.get_native_id())]
    assert again[0] > sample[str(threading.get_native_id())][0]


def test_governor_sees_a_real_competing_load():
    """One busy process per core beside torch's own pool: this process's threads wait for a CPU and the
    governor gives up a thread. Holds under any extra load (more load, more waiting)."""
    import torch

    cpus = threads.available_cpus()
    if cpus < 2 or not threads.own_schedstat():
        return  # one core: nothing to give up; no schedstat: nothing to read
    before = torch.get_num_threads()
    busy = [subprocess.Popen([sys.executable, "-c", "while True:\n    pass"]) for _ in range(cpus)]
    try:
        torch.set_num_threads(cpus)
        gov = threads.ThreadGovernor(cpus)
        a = torch.randn(256, 256)
        deadline = time.monotonic() + 20.0
        while gov.threads == cpus and time.monotonic() < deadline:
            for _ in range(200):
                a = torch.tanh(a @ a)  # a phase of parallel work
            gov.observe()
        assert gov.threads < cpus, f"wait share {gov.wait_share:.2f} with {cpus} busy processes"
        assert torch.get_num_threads() == gov.threads
    finally:
        for p in busy:
            p.kill()
            p.wait()
        torch.set_num_threads(before)


def _controller(tmp_path, run: dict):
    from omnirl_core.loop.controller import Controller
    from omnirl_core.plugins import PluginManager
    from omnirl_core.resolve import resolve_run

    manager = PluginManager()
    manager.load_modules(["omnirl_plugin_cpu", "omnirl_plugin_qwen_image", "omnirl_plugin_flowgrpo",
                          "omnirl_plugin_diffusers", "omnirl_plugin_torch", "omnirl_plugin_color"])
    resolved = resolve_run(manager, [{
        "model": {"name": "qwen-image", "preset": "tiny"}, "algorithm": {"name": "flowgrpo"},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "num_steps": 3, "height": 32, "width": 32},
        "run": {"device": "cpu", "output_dir": str(tmp_path), "save_every": 100, "sample_every": 100, **run},
    }])
    ctl = Controller(resolved, tmp_path)
    ctl.run_dir.prepare(resolved.dump(), [])
    ctl.setup()
    return ctl


def test_the_default_run_rejudges_its_pool_once_per_step_and_reports_it(tmp_path):
    """The default policy (adaptive) through the real controller (tiny Qwen-Image, inline): the governor is
    consulted once per step, before the rollout, and the update runs on the pool the rollout ran on (the
    trainer re-evaluates the rollout's log-probs with the same arithmetic); every step's row carries that pool
    and the wait share that set it, and runtime.json says the policy is adaptive. The governor's clock is
    scripted to report a loaded machine, and its probe to see another process, so the pool really moves whatever
    else runs on the machine."""
    import json

    import torch

    before = torch.get_num_threads()
    try:
        ctl = _controller(tmp_path, {})
        worker = ctl.executor.worker
        gov = worker.governor
        assert gov is not None and gov.ceiling == threads.available_cpus()
        clock = _Clock()
        gov.sample, gov._last = clock, clock()
        # the machine as the governor probes it, scripted too: another process runnable, so the machine is never
        # free (the real probe would see an idle machine at times and take the thread back at once)
        gov.probe = lambda: 1
        observed, update_pools = [], []
        observe = gov.observe

        def loaded_observe() -> int:
            clock.phase(1.0, 1.0)  # half the runnable time spent waiting: give up a thread (down to 1)
            observed.append(observe())
            return observed[-1]

        gov.observe = loaded_observe
        update = worker.trainer.update

        def recording_update(*args, **kwargs):
            update_pools.append(torch.get_num_threads())
            return update(*args, **kwargs)

        worker.trainer.update = recording_update
        rows = [ctl.train_step(step) for step in (1, 2, 3)]
        ctl.executor.close()
    finally:
        torch.set_num_threads(before)
    assert len(observed) == 3  # once per step, not again before the update
    assert update_pools == observed == [row["threads/torch"] for row in rows]
    assert observed[-1] == 1
    assert all(row["threads/wait_share"] == 0.5 for row in rows)
    runtime = json.loads((tmp_path / "runtime.json").read_text())
    assert runtime["threads"]["adaptive"] is True


def test_a_fixed_pool_is_never_resized(tmp_path):
    import json

    import torch

    before = torch.get_num_threads()
    try:
        ctl = _controller(tmp_path, {"threads": "fixed"})
        assert ctl.executor.worker.governor is None
        rows = [ctl.train_step(step) for step in (1, 2)]
        assert torch.get_num_threads() == threads.available_cpus()
        ctl.executor.close()
    finally:
        torch.set_num_threads(before)
    assert all("threads/torch" not in row for row in rows)
    runtime = json.loads((tmp_path / "runtime.json").read_text())
    assert runtime["threads"]["adaptive"] is False and runtime["threads"]["intra_op"] == threads.available_cpus()
