"""The Ray executor against the inline one: same seeds, same metrics (colocated and split placement,
LoRA weights synced to the rollout worker, a separate reference worker); and its placement errors. Ray on this machine:
``ray.init(num_cpus=2)``; the run's plugins are registered explicitly."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest

from omnirl_core.errors import UsageError
from omnirl_core.loop.controller import Controller
from omnirl_core.plugins import PluginManager
from omnirl_core.resolve import resolve_run

ray = pytest.importorskip("ray")

PLUGINS = ["omnirl_plugin_cpu", "omnirl_plugin_qwen_image", "omnirl_plugin_flowgrpo", "omnirl_plugin_diffusers",
           "omnirl_plugin_torch", "omnirl_plugin_color"]
STEPS = 2


def _resolved(out: Path, lora: bool = True, **run):
    manager = PluginManager()
    manager.load_modules(PLUGINS)
    layers = [{
        "model": {"name": "qwen-image", "preset": "tiny", "lora": {"enabled": lora, "rank": 4, "alpha": 4}},
        "algorithm": {"name": "flowgrpo", "options": {"beta": 0.05}},  # a KL term: the reference is used
        "rewards": [{"name": "color"}],
        "rollout": {"prompts_per_step": 2, "group_size": 4, "num_steps": 3, "height": 32, "width": 32},
        "train": {"lr": 1e-2 if lora else 1e-4, "minibatches": 2, "micro_batch_size": 8},
        "run": {"seed": 11, "steps": STEPS, "output_dir": str(out), "device": "cpu", "save_every": 100,
                "sample_every": 100, **run},
    }]
    return resolve_run(manager, layers)


def _metrics(out: Path, lora: bool = True, **run) -> list[dict]:
    resolved = _resolved(out, lora, **run)
    controller = Controller(resolved, out)
    controller.run_dir.prepare(resolved.dump(), [])
    controller.run()
    return controller.run_dir.read_metrics()


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) == STEPS
    for ra, rb in zip(a, b):
        keys = {k for k in ra if not k.startswith(("time/", "images_per_s", "sync/", "rollout/threads", "threads/"))}
        assert keys <= set(rb)
        for key in keys:
            assert math.isclose(ra[key], rb[key], rel_tol=1e-4, abs_tol=1e-7), (key, ra[key], rb[key])


@pytest.fixture(scope="module")
def inline_metrics(tmp_path_factory) -> list[dict]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a 1-CPU Ray actor: the same float reduction order
    try:
        return _metrics(tmp_path_factory.mktemp("inline"))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_colocated_run_matches_inline(ray_cluster, inline_metrics, tmp_path: Path):
    got = _metrics(tmp_path, executor="ray", placement="colocated")
    _same(inline_metrics, got)
    assert all("sync/bytes" not in r for r in got)  # one model: nothing to copy
    assert (tmp_path / "checkpoints" / "step-000002" / "pytorch_lora_weights.safetensors").is_file()


def test_the_colocated_worker_keeps_the_trajectories(ray_cluster, tmp_path: Path):
    """Colocated, FlowGRPO: the controller's samples come without trajectories (one object per sample in the
    stream), the update gets the worker's own back; an evaluation rollout (no update) and a split placement
    stream whole samples."""
    from omnirl_core.loop.ray_executor import HELD_KEY

    resolved = _resolved(tmp_path / "colocated", executor="ray", placement="colocated")
    controller = Controller(resolved, tmp_path / "colocated")
    controller.run_dir.prepare(resolved.dump(), [])
    try:
        controller.setup()
        assert controller.executor.hold
        assert controller.executor.reward_batching  # colour scores each image on its own: batched as they pile up
        samples, _ = controller.collect(1)
        assert len(samples) == 8
        assert all(s.latents is None and s.logprobs is None and "cond" not in s.extras for s in samples)
        assert sorted(s.extras[HELD_KEY] for s in samples) == list(range(8))
        assert all(s.output.shape == (3, 32, 32) for s in samples)  # the controller's grid and trackers read it
        record = controller.learn(1, samples, {"time/collect_s": 0.0})
        assert math.isfinite(record["loss"]) and math.isfinite(record["kl"])
        evaluated, _ = controller.executor.rollout(controller.requests(1), evaluation=True)
        assert all(s.latents is not None and HELD_KEY not in s.extras for s in evaluated)
    finally:
        controller.executor.close()
    split = Controller(_resolved(tmp_path / "split", executor="ray", placement="split", worker_cpus=0.5),
                       tmp_path / "split")
    assert not split.executor.hold  # set at setup; the split test checks its run against inline


def test_a_reward_slot_that_frees_takes_the_waiting_samples_before_the_next_one_arrives(ray_cluster, tmp_path: Path):
    """Two samples come at once to one slot, then the rollout is slow to make the third: the second sample goes to
    the slot when its first call finishes, not when the third sample arrives (which waits for a file here)."""
    import threading
    import time

    from omnirl_core.loop.ray_executor import _RewardDispatch, consume_stream

    flag = tmp_path / "third"

    @ray.remote(num_cpus=0)
    def rollout():
        yield "a"
        yield "b"
        while not flag.exists():
            time.sleep(0.05)
        yield "c"

    @ray.remote(num_cpus=0)
    class Scorer:
        def score(self, *views):
            time.sleep(0.5)  # still busy when "b" arrives
            return [({}, 0.0) for _ in views], 0.5

    dispatch = _RewardDispatch([Scorer.remote()], concurrency=1, batching=False)
    out: list = []
    reader = threading.Thread(target=lambda: out.append(consume_stream(
        rollout.options(num_returns="streaming").remote(), dispatch, hold=True, score=True)))
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while len(dispatch.calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(dispatch.calls) == 2, "the waiting sample stayed queued until the next one arrived"
    finally:
        flag.touch()
        reader.join(60)
    views, samples = out[0]
    assert ray.get(views) == ray.get(samples) == ["a", "b", "c"]
    dispatch.drain()
    assert len(ray.get(dispatch.calls)) == 3


def test_samples_that_finish_together_go_in_one_call_to_a_reward_that_judges_a_batch(ray_cluster, monkeypatch):
    """Coalescing (the rewards have ``submit``): a wave of three samples that leave the rollout back to back goes
    in one call; the next sample, which comes later, in another, though the first call still runs."""
    import time

    from omnirl_core.loop import ray_executor
    from omnirl_core.loop.ray_executor import _RewardDispatch, consume_stream

    monkeypatch.setattr(ray_executor, "COALESCE_S", 0.3)  # a wave's gaps on a loaded machine, well under the next's

    @ray.remote(num_cpus=0)
    def rollout():
        for view in ("a", "b", "c"):  # noqa: UP028 - Ray's generator protocol needs real yields (no .send)
            yield view
        time.sleep(2.0)  # the next wave
        yield "d"

    @ray.remote(num_cpus=0, max_concurrency=2)
    class Scorer:
        def __init__(self, seconds: float):
            self.seconds = seconds

        async def score(self, *views):
            import asyncio

            await asyncio.sleep(self.seconds)
            return list(views)

    # still judging the first wave when "d" comes, and after: one call per actor at once would hold "d" back until
    # the first call ends, but a reward with submit has no slots
    dispatch = _RewardDispatch([Scorer.remote(4.0)], concurrency=1, batching=False, coalesce=4)
    views, _ = consume_stream(rollout.options(num_returns="streaming").remote(), dispatch, hold=True, score=True)
    dispatch.drain()
    assert ray.get(views) == ["a", "b", "c", "d"]
    assert len(dispatch.calls) == 2 and ray.wait(dispatch.calls, num_returns=2, timeout=0)[0] == []  # both running
    assert ray.get(dispatch.calls) == [["a", "b", "c"], ["d"]]
    # without coalescing, the same stream: a call per sample while slots are free
    plain = _RewardDispatch([Scorer.remote(1.0)], concurrency=2, batching=False)
    consume_stream(rollout.options(num_returns="streaming").remote(), plain, hold=True, score=True)
    plain.drain()
    assert [len(c) for c in ray.get(plain.calls)] == [1, 1, 1, 1]


def test_a_remote_judge_on_ray_scores_each_wave_in_one_call_of_an_async_actor(ray_cluster, tmp_path: Path,
                                                                             monkeypatch):
    """The vlm-judge reward (``submit``) on a Ray reward actor, async mode, against the stand-in judge served on
    127.0.0.1: every sample gets the score the judge gives it when called directly, in fewer calls than
    samples (the colocated worker finishes its 4 requests of a wave together)."""
    import threading

    from omnirl_plugin_vlm_judge.options import VLMJudgeOptions
    from omnirl_plugin_vlm_judge.reward import VLMJudge
    from omnirl_plugin_vlm_judge.server import make_server

    from omnirl_core.loop import ray_executor

    monkeypatch.setattr(ray_executor, "COALESCE_S", 0.3)  # a wave's gaps on a loaded machine
    server = make_server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    manager = PluginManager()
    manager.load_modules([*PLUGINS, "omnirl_plugin_vlm_judge"])
    resolved = resolve_run(manager, [{
        "model": {"name": "qwen-image", "preset": "tiny", "lora": {"rank": 4, "alpha": 4}},
        "algorithm": {"name": "flowgrpo"},
        "rewards": [{"name": "vlm-judge", "options": {"url": url, "model": "stand-in", "concurrency": 4}}],
        "data": {"prompts": "builtin:colors"},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "num_steps": 3, "height": 32, "width": 32,
                    "options": {"max_num_seqs": 4, "decode_batch": 4}},
        "run": {"seed": 11, "steps": 1, "output_dir": str(tmp_path), "device": "cpu", "executor": "ray",
                "placement": "colocated", "reward_mode": "async", "reward_workers": 1},
    }])
    controller = Controller(resolved, tmp_path)
    controller.run_dir.prepare(resolved.dump(), [])
    judge = VLMJudge(VLMJudgeOptions(url=url, model="stand-in"))
    try:
        controller.setup()
        assert controller.executor.reward_coalesce == 4  # the judge's concurrency
        samples, metrics = controller.collect(1)
        want = judge([s.output for s in samples], [s.prompt for s in samples])
        assert [s.rewards["vlm-judge"] for s in samples] == want
        assert len(set(want)) > 1  # images of different brightness: a mix-up would show
        assert 1 <= metrics["time/reward_calls"] < len(samples)
    finally:
        judge.close()
        controller.executor.close()
        server.shutdown()
        server.server_close()


def test_restoring_trajectories_keeps_the_controllers_fields_and_names_a_missing_one():
    import torch

    from omnirl_core.contracts import GenRequest, Sample
    from omnirl_core.flow.policy_gradient import Transition
    from omnirl_core.loop.ray_executor import HELD_KEY, restore_trajectories, reward_view, shed_outputs

    def sample(uid: int) -> Sample:
        request = GenRequest(uid=uid, prompt=f"p{uid}", prompt_index=uid, group=0, seed=uid, height=8, width=8,
                             plan=None)
        return Sample(request=request, latents=torch.full((3, 2), float(uid)), sigmas=torch.ones(3),
                      logprobs=torch.zeros(2), output=torch.zeros(3, 8, 8), extras={"cond": uid})

    held = {0: sample(0), 1: sample(1)}
    light = []
    for key, full in held.items():
        view = reward_view(full)
        view.extras[HELD_KEY] = key
        view.reward, view.advantage = 0.5 + key, -1.0 + key  # what the controller set
        light.append(view)
    units = [Transition(s, j) for s in light for j in (0, 1)]  # units share their sample
    assert restore_trajectories(units, held) == 2
    for key, s in enumerate(light):
        assert s.latents is held[key].latents and s.extras == {"cond": key}
        assert (s.reward, s.advantage) == (0.5 + key, -1.0 + key)
    # the units as the executor sends them: without the outputs, which the worker puts back
    views = []
    for key, full in held.items():
        view = reward_view(full)
        view.extras[HELD_KEY] = key
        views.append(view)
    mine = [Transition(s, j) for s in views for j in (0, 1)]
    sent = pickle.loads(pickle.dumps(shed_outputs(mine)))  # travels as one object
    assert all(u.sample.output is not None for u in mine)  # the controller's units are left as they are
    assert all(u.sample.output is None for u in sent) and sent[0].sample is sent[1].sample
    assert restore_trajectories(sent, held) == 2
    assert all(u.sample.output is held[u.sample.extras["cond"]].output for u in sent)
    stray = reward_view(sample(5))
    stray.extras[HELD_KEY] = 5
    with pytest.raises(RuntimeError, match=r"held key 5, prompt 'p5'.*later rollout"):
        restore_trajectories([Transition(stray, 0)], held)


def test_ray_split_run_syncs_lora_and_matches_inline(ray_cluster, inline_metrics, tmp_path: Path):
    got = _metrics(tmp_path, executor="ray", placement="split", worker_cpus=0.5, reward_mode="sync")
    _same(inline_metrics, got)
    # only the LoRA weights move: rank 4 adapters on the tiny transformer, fp32
    from safetensors.torch import load_file

    lora = load_file(str(tmp_path / "checkpoints" / "step-000002" / "pytorch_lora_weights.safetensors"))
    assert got[0]["sync/bytes"] == sum(t.numel() * 4 for t in lora.values())


def test_ray_separate_reference_worker_matches_inline(ray_cluster, inline_metrics, tmp_path: Path):
    # one threaded reward actor serving 2 calls at once instead of 2 reward processes
    got = _metrics(tmp_path, executor="ray", reference="separate", worker_cpus=0.5, reward_workers=1,
                   reward_concurrency=2)
    _same(inline_metrics, got)
    assert all(r["kl"] > 0 for r in got)  # the KL term was computed, from the reference worker's outputs


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_inline_separate_reference_worker_matches_the_actor_reference(tmp_path: Path, lora: bool):
    """The reference worker computes what the actor's own reference would (LoRA disabled, or the frozen
    copy the actor keeps in full fine-tuning); with a separate worker the actor keeps no copy."""
    own = _metrics(tmp_path / "own", lora)
    resolved = _resolved(tmp_path / "separate", lora, reference="separate")
    controller = Controller(resolved, tmp_path / "separate")
    controller.run_dir.prepare(resolved.dump(), [])
    controller.run()
    _same(own, controller.run_dir.read_metrics())
    assert all(r["kl"] > 0 for r in own[1:])
    if not lora:
        assert controller.executor.model._reference_copy is None


def test_colocated_with_several_train_ranks_is_refused(tmp_path: Path):
    from omnirl_core.loop.ray_executor import RayExecutor

    with pytest.raises(UsageError, match="placement=split"):
        RayExecutor(_resolved(tmp_path, executor="ray", train_workers=2))
    with pytest.raises(UsageError, match="distributed engine"):
        RayExecutor(_resolved(tmp_path, executor="ray", placement="split", train_workers=2))


def test_pools_larger_than_the_cluster_fail_at_once(ray_cluster, tmp_path: Path):
    import time

    start = time.perf_counter()
    with pytest.raises(UsageError, match=r"too small.*CPU 2.5 needed, 2 in the cluster"):
        _metrics(tmp_path, executor="ray", placement="split", reference="separate", worker_cpus=0.5,
                 reward_workers=2)  # 3 workers x 0.5 + 2 reward actors x 0.5
    assert time.perf_counter() - start < 60  # not the 120 s placement timeout
    assert ray.available_resources().get("CPU") == 2.0  # nothing was left placed


def test_actors_size_torch_to_the_cpus_ray_assigned_them(ray_cluster, tmp_path: Path):
    """Ray does not pin actors to cores: each sizes torch's pools to its own CPUs, not to the machine's."""
    from omnirl_core.host.threads import available_cpus, ray_assigned_cpus
    from omnirl_core.loop.ray_executor import RewardActor, actor_runtime_env

    assert ray_assigned_cpus() is None  # the driver
    resolved = _resolved(tmp_path)
    for cpus, expected in ((0.5, 1), (1, 1), (2, min(2, available_cpus()))):  # one at a time: a 2-CPU cluster
        options = {"num_cpus": cpus, "runtime_env": actor_runtime_env(resolved.config.run, "reward")}
        actor = ray.remote(RewardActor).options(**options).remote(resolved)
        try:
            assert ray.get(actor.torch_threads.remote(), timeout=120) == expected, cpus
        finally:
            ray.kill(actor)


def test_actors_run_at_the_drivers_priority(ray_cluster, tmp_path: Path):
    """run.ray_worker_niceness (0 by default) runs every actor at the driver's priority, where Ray's own default
    renices workers by 15 (any other process on a busy node then takes the actors' CPUs first)."""
    import os

    from omnirl_core.loop.ray_executor import RayExecutor

    executor = RayExecutor(_resolved(tmp_path, executor="ray"))
    executor.setup()
    try:
        actors = [*executor.train, *executor.reward_actors]
        got = ray.get([a.__ray_call__.remote(lambda self: os.getpriority(os.PRIO_PROCESS, 0)) for a in actors],
                      timeout=120)
    finally:
        executor.close()
    assert got == [os.getpriority(os.PRIO_PROCESS, 0)] * len(actors)


def test_the_niceness_setting_reaches_each_actors_runtime_environment(tmp_path: Path):
    from omnirl_core.loop.ray_executor import actor_runtime_env

    def env(**run):
        return actor_runtime_env(_resolved(tmp_path, executor="ray", **run).config.run, "reward")

    assert env() == {"env_vars": {"RAY_worker_niceness": "0"}}
    assert env(ray_worker_niceness=5) == {"env_vars": {"RAY_worker_niceness": "5"}}
    assert env(ray_worker_niceness=None) == {}  # Ray's own (15)
    own = {"reward": {"env_vars": {"RAY_worker_niceness": "10", "X": "1"}}}
    assert env(ray_runtime_envs=own) == {"env_vars": {"RAY_worker_niceness": "10", "X": "1"}}


def test_a_worker_group_runs_in_its_own_runtime_environment(ray_cluster, inline_metrics, tmp_path: Path):
    """run.ray_runtime_envs: the reward group's actors start through another interpreter (here a wrapper that
    records each process it starts, then runs this venv's python) with their own variables; the run is the
    inline run. A reward model with conflicting dependencies runs the same way in an environment of its own."""
    import os
    import sys

    marker = tmp_path / "started"
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f'#!/bin/sh\necho "$$ $OMNIRL_TEST_GROUP" >> {marker}\nexec {sys.executable} "$@"\n')
    os.chmod(wrapper, 0o755)
    envs = {"reward": {"py_executable": str(wrapper), "env_vars": {"OMNIRL_TEST_GROUP": "reward"}}}
    _same(inline_metrics, _metrics(tmp_path / "run", executor="ray", ray_runtime_envs=envs))
    started = marker.read_text().split("\n")
    assert any(line.endswith(" reward") for line in started), started


def test_runtime_environment_mistakes_are_clear(tmp_path: Path):
    from omnirl_core.loop.ray_executor import group_runtime_env

    with pytest.raises(UsageError, match=r"unknown keys \['conda'\]"):
        group_runtime_env({"conda": "x"}, "reward")
    with pytest.raises(UsageError, match="does not exist"):
        group_runtime_env({"py_executable": str(tmp_path / "nope" / "python")}, "rollout")
    with pytest.raises(UsageError, match="No environment declared for 'no-such-engine'"):
        group_runtime_env({"environment": "no-such-engine"}, "rollout")
    assert group_runtime_env({"env_vars": {"A": "1"}}, "train") == {"env_vars": {"A": "1"}}


def test_rewards_that_score_each_sample_on_its_own_are_batched_without_reward_batching(tmp_path: Path):
    """Colour declares ``batch_invariant``: inline, its reward threads take what piled up (as with
    run.reward_batching); a reward that does not declare it, alone or beside colour, keeps a call per sample."""
    from omnirl_plugin_color.reward import ColorMatch

    from omnirl_core.rewards.dispatch import RewardFn, RewardSet

    resolved = _resolved(tmp_path)
    controller = Controller(resolved, tmp_path)
    controller.run_dir.prepare(resolved.dump(), [])
    try:
        controller.setup()
        assert resolved.config.run.reward_batching is False and controller.executor.stream.batch_async
    finally:
        controller.executor.close()

    def plain(outputs, prompts):
        return [0.0] * len(outputs)

    assert RewardSet([RewardFn("colour", ColorMatch())]).batch_invariant
    assert not RewardSet([RewardFn("plain", plain)]).batch_invariant
    assert not RewardSet([RewardFn("colour", ColorMatch()), RewardFn("plain", plain)]).batch_invariant
