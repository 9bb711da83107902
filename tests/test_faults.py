"""Faulty rewards: each fault ends in a clear error within the deadline or a counted drop; never a hang, a
silent 0, or a NaN that reaches training. The faults come from ``fixture_plugins/faulty_rewards.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnirl_core.contracts import GenRequest, RolloutPlan, Sample
from omnirl_core.loop.controller import Controller
from omnirl_core.plugins import PluginManager
from omnirl_core.resolve import resolve_run
from omnirl_core.rewards.dispatch import RewardError, RewardHealth

FIXTURES = Path(__file__).parent / "fixture_plugins"
PLUGINS = ["omnirl_plugin_cpu", "omnirl_plugin_qwen_image", "omnirl_plugin_flowgrpo", "omnirl_plugin_diffusers",
           "omnirl_plugin_torch", "omnirl_plugin_color", "faulty_rewards"]


def _run(out: Path, rewards: list[dict], steps: int = 2, **run) -> list[dict]:
    sys.path.insert(0, str(FIXTURES))
    try:
        manager = PluginManager()
        manager.load_modules(PLUGINS)
        resolved = resolve_run(manager, [{
            "model": {"name": "qwen-image", "preset": "tiny", "lora": {"rank": 4, "alpha": 4}},
            "algorithm": {"name": "flowgrpo"},
            "rewards": rewards,
            "rollout": {"prompts_per_step": 2, "group_size": 4, "num_steps": 3, "height": 32, "width": 32},
            "run": {"steps": steps, "device": "cpu", "save_every": 100, "sample_every": 100, **run},
        }])
        controller = Controller(resolved, out)
        controller.run_dir.prepare(resolved.dump(), [])
        controller.run()
        return controller.run_dir.read_metrics()
    finally:
        sys.path.remove(str(FIXTURES))


def _faulty(mode: str, required: bool = True, **options) -> dict:
    return {"name": "faulty", "required": required, "options": {"mode": mode, **options}}


@pytest.mark.parametrize(("mode", "message"), [
    ("raise", "RuntimeError: the scorer crashed"),
    ("nan", "non-finite score nan"),
    ("count", "returned 2 scores for 1 samples"),
    ("str", "' (str); a score must be a real number"),
    ("bool", "True (bool); a score must be a real number"),
    ("none", "returned a NoneType; expected a list of 1 numbers"),
])
def test_a_required_reward_that_misbehaves_fails_the_step_with_what_it_did(tmp_path, mode, message):
    with pytest.raises(RewardError, match="Required reward 'faulty' failed") as err:
        _run(tmp_path, [_faulty(mode)])
    assert message in err.value.render()
    assert not (tmp_path / "checkpoints").exists() and _rows(tmp_path) == []  # nothing half-written


def test_a_hung_reward_fails_at_its_deadline(tmp_path):
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"no answer within 1 s \(run.reward_timeout_s\)"):
        _run(tmp_path, [_faulty("hang")], reward_timeout_s=1.0)
    assert time.monotonic() - start < 120  # without the deadline it never ends


def test_a_slow_reward_is_waited_for(tmp_path):
    rows = _run(tmp_path, [_faulty("slow", delay_s=0.05)])
    assert [r["step"] for r in rows] == [1, 2] and all(0 < r["reward/faulty"] < 1 for r in rows)


def test_an_optional_reward_that_fails_on_some_samples_is_dropped_for_their_whole_groups(tmp_path):
    rows = _run(tmp_path, [{"name": "color"}, _faulty("fail-odd", required=False)], steps=2)
    dropped = [r["reward/faulty/dropped_frac"] for r in rows]
    assert all(d == 1.0 for d in dropped)  # every other sample fails: every group of 4 has a failure
    assert all(r["reward/groups_without_reward_frac"] == 0.0 for r in rows)  # color still scores them
    assert all(r["reward/mean"] == r["reward/color"] for r in rows)  # the total holds color alone


def test_an_optional_reward_that_always_fails_stops_the_run_after_its_patience(tmp_path):
    with pytest.raises(RewardError, match="Optional reward 'faulty' failed on every sample for 2 steps in a row"):
        _run(tmp_path, [{"name": "color"}, _faulty("raise", required=False)], steps=4, reward_max_failed_steps=2)
    assert [r["step"] for r in _rows(tmp_path)] == [1]  # step 1 trained on color alone, step 2 stopped


def test_a_step_where_every_reward_failed_is_an_error_not_zeros(tmp_path):
    with pytest.raises(RewardError, match="No reward could be computed for any sample at step 1"):
        _run(tmp_path, [_faulty("raise", required=False)], reward_max_failed_steps=5)


def _sample(group: int, uid: int, rewards: dict[str, float]) -> Sample:
    request = GenRequest(uid=uid, prompt="p", prompt_index=group, group=group, seed=uid, height=8, width=8,
                         plan=RolloutPlan(step_kinds=(), train_steps=()))
    sample = Sample(request=request, latents=None, sigmas=None, logprobs=None, output=None)
    sample.rewards = dict(rewards)
    return sample


def test_group_settlement_compares_group_mates_on_the_same_rewards():
    class Entry:
        def __init__(self, name, weight, required):
            self.name, self.weight, self.required = name, weight, required

    entries = [Entry("a", 1.0, True), Entry("b", 2.0, False)]
    samples = [_sample(0, 0, {"a": 1.0, "b": 1.0}), _sample(0, 1, {"a": 0.0}),  # b failed on uid 1
               _sample(1, 2, {"a": 1.0, "b": 1.0}), _sample(1, 3, {"a": 0.0, "b": 0.0})]
    metrics = RewardHealth(3).settle(samples, entries, step=1)
    assert [s.reward for s in samples] == [1.0, 0.0, 3.0, 0.0]  # group 0 on 'a' alone, group 1 on both
    assert "b" not in samples[0].rewards
    assert metrics == {"reward/b/dropped_frac": 0.5, "reward/groups_without_reward_frac": 0.0}


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_ctrl_c_stops_a_run_whose_reward_hangs(tmp_path):
    exe = Path(sys.executable).with_name("omnirl")
    env = {**os.environ, "PYTHONPATH": str(FIXTURES), "OMNIRL_PLUGINS": "faulty_rewards"}
    proc = subprocess.Popen([str(exe), "train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny",
                             "--reward", "faulty", "--set", "rewards.0.options.mode=hang",
                             "--set", "rewards.0.options.from_call=8", "--set", "run.reward_timeout_s=null",
                             "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
                             "--steps", "3", "--output-dir", str(tmp_path / "run")],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    deadline = time.monotonic() + 300
    while not _rows(tmp_path / "run") and time.monotonic() < deadline:  # step 1 done; step 2's reward hangs
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "latest checkpoint step-000001" in stderr
    assert [r["step"] for r in _rows(tmp_path / "run")] == [1]


def test_deadline_threads_are_reused_and_a_hung_call_keeps_its_own():
    """Reward calls run on reused daemon threads: consecutive calls share one; a call past its deadline keeps its
    thread (the next call gets another) until it returns; an idle thread ends."""
    import threading

    from omnirl_core.rewards.dispatch import DeadlineThreads, RewardTimeout, call_with_deadline

    pool = DeadlineThreads(idle_s=0.5)
    first = pool.submit(threading.get_ident).result(timeout=10)
    assert pool.submit(threading.get_ident).result(timeout=10) == first
    release = threading.Event()
    hung = pool.submit(lambda: (release.wait(30), threading.get_ident())[1])
    other = pool.submit(threading.get_ident).result(timeout=10)
    assert other != first  # the hung call's thread is busy
    release.set()
    assert hung.result(timeout=10) == first
    assert pool.submit(threading.get_ident).result(timeout=10) in (first, other)  # back among the idle ones
    deadline = time.monotonic() + 10
    while any(t.ident in (first, other) for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.ident in (first, other) for t in threading.enumerate()), "idle threads did not end"
    assert pool.submit(lambda: 7).result(timeout=10) == 7  # a new thread after the idle ones ended

    if hasattr(os, "fork"):  # a forked child never hands a call to the parent's idle threads (absent there)
        pool.submit(threading.get_ident).result(timeout=10)  # one idle thread in this process
        os.register_at_fork(after_in_child=pool._forget)
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the call is answered
            code = 1
            try:
                code = 0 if pool.submit(lambda: 7).result(timeout=10) == 7 else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0

    with pytest.raises(RewardTimeout, match="no answer within 0.2 s"):
        call_with_deadline(lambda: release.clear() or release.wait(2), 0.2)
    with pytest.raises(ValueError, match="boom"):
        call_with_deadline(lambda: (_ for _ in ()).throw(ValueError("boom")), 5)
