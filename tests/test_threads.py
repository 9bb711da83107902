"""The thread policy: the cores a process may use (affinity, cgroup quota) and the OpenMP wait setting,
applied before torch loads and never over what the user set."""

from __future__ import annotations

import os
import subprocess
import sys

from omnirl_core.runtime import threads


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
    threads.apply_env(3, env)
    assert env == {"OMP_NUM_THREADS": "3", "GOMP_SPINCOUNT": threads.DEFAULT_SPINCOUNT}
    env = {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "5"}
    threads.apply_env(3, env)
    assert env == {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "5"}
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    threads.apply_env(None, env)
    assert "GOMP_SPINCOUNT" not in env  # the user's wait policy decides


def test_the_cli_applies_the_policy_before_torch_loads():
    code = ("import os, sys; import omnirl_cli.main; "
            "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == [threads.DEFAULT_SPINCOUNT, "False"]


def test_configure_sizes_torch_and_reports_the_policy():
    import torch

    before = torch.get_num_threads()
    try:
        policy = threads.configure(1)
        assert torch.get_num_threads() == 1 and policy.intra_op == 1 and policy.cpus >= 1
        assert set(policy.as_dict()) == {"cpus", "intra_op", "inter_op", "spincount", "wait_policy"}
    finally:
        torch.set_num_threads(before)
