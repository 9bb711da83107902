"""Rewards as a Ray Serve deployment (run.reward_serving=serve) against the reward actors: the same tiny FlowGRPO run
scores, trains and saves the same thing bit for bit; replicas carry the reward pool's selector and the autoscaling
settings; only batch-invariant rewards are batched across requests; a failing required reward stops the run with
its name; Serve is gone after the run, whether it ended or failed. One Ray instance for the module (3 CPUs, a custom
``reward`` resource that the reward pool selects)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from omnirl_core.errors import ConfigError
from omnirl_core.loop.controller import Controller
from omnirl_core.plugins import PluginManager
from omnirl_core.resolve import resolve_run
from omnirl_core.rewards.dispatch import RewardError

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve", exc_type=ImportError)

FIXTURES = str(Path(__file__).parent / "fixture_plugins")  # faulty_rewards: a reward that fails on purpose
PLUGINS = ["omnirl_plugin_cpu", "omnirl_plugin_qwen_image", "omnirl_plugin_flowgrpo", "omnirl_plugin_diffusers",
           "omnirl_plugin_torch", "omnirl_plugin_color", "faulty_rewards"]
STEPS = 2
POOL = {"reward": {"resources": {"reward": 0.001}}}  # the reward group on the nodes with the custom resource
SERVE = {"reward_serving": "serve", "ray_pools": POOL,
         "reward_serve": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 4, "max_batch_size": 4,
                          "max_ongoing_requests": 8, "batch_wait_s": 0.05}}


@pytest.fixture(scope="module")
def ray_cluster():
    sys.path.insert(0, FIXTURES)
    path = os.pathsep.join([FIXTURES, *filter(None, [os.environ.get("PYTHONPATH")])])
    ray.init(num_cpus=3, resources={"reward": 1}, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()
    sys.path.remove(FIXTURES)


def _resolved(out: Path, rewards: list[dict] | None = None, steps: int = STEPS, **run):
    manager = PluginManager()
    manager.load_modules(PLUGINS)
    return resolve_run(manager, [{
        "model": {"name": "qwen-image", "preset": "tiny", "lora": {"rank": 4, "alpha": 4}},
        "algorithm": {"name": "flowgrpo", "options": {"beta": 0.05}},
        "rewards": rewards or [{"name": "color"}],
        "rollout": {"prompts_per_step": 2, "group_size": 4, "num_steps": 3, "height": 32, "width": 32},
        "train": {"lr": 1e-2, "minibatches": 2, "micro_batch_size": 8},
        "run": {"seed": 11, "steps": steps, "output_dir": str(out), "device": "cpu", "save_every": 100,
                "sample_every": 100, "executor": "ray", "placement": "colocated", "threads": 1, **run},
    }])


def _run(out: Path, rewards: list[dict] | None = None, steps: int = STEPS, **run) -> Controller:
    resolved = _resolved(out, rewards, steps, **run)
    controller = Controller(resolved, out)
    controller.run_dir.prepare(resolved.dump(), [])
    controller.run()
    return controller


def _serve_running() -> bool:
    from omnirl_core.loop.ray_serve_rewards import serve_running

    return serve_running()


def test_served_rewards_train_exactly_as_the_reward_actors(ray_cluster, tmp_path: Path):
    """Actors, then Serve (autoscaling 1..2 replicas, batching): the same metrics and final weights, bit for bit."""
    actors = _run(tmp_path / "actors", ray_pools=POOL)
    served = _run(tmp_path / "serve", **SERVE)
    assert not _serve_running()  # the run started Serve and took it down
    a, s = actors.run_dir.read_metrics(), served.run_dir.read_metrics()
    assert len(a) == len(s) == STEPS
    for ra, rs in zip(a, s):
        keys = {k for k in ra if not k.startswith(("time/", "images_per_s", "sync/", "rollout/threads", "threads/"))}
        assert keys and keys <= set(rs)
        assert {k: ra[k] for k in keys} == {k: rs[k] for k in keys}  # exactly
        assert math.isfinite(rs["loss"])
    weights = "checkpoints/step-000002/pytorch_lora_weights.safetensors"
    assert (tmp_path / "actors" / weights).read_bytes() == (tmp_path / "serve" / weights).read_bytes()
    record = json.loads((tmp_path / "serve" / "runtime.json").read_text())
    ray_record = record["ray"]
    serve_record = ray_record["reward_serve"]
    assert serve_record["ray_actor_options"] == {"num_cpus": 0.5, "resources": {"reward": 0.001}}
    assert (serve_record["min_replicas"], serve_record["max_replicas"]) == (1, 2)
    assert serve_record["started_serve"] and len(serve_record["replicas_at_start"]) == 1
    assert ray_record["groups"]["reward"][0]["node_id"] == serve_record["replicas_at_start"][0]["node_id"]


def test_the_deployment_takes_the_pools_selector_and_batches_only_batch_invariant_rewards(ray_cluster,
                                                                                          tmp_path: Path):
    """Colour declares batch_invariant: eight requests sent together are scored in batches (of at most
    max_batch_size), each sample as it scores alone. The faulty fixture does not declare it: every request is scored
    in a call of its own. A second application on a Serve instance that runs already leaves it running."""
    import torch
    from ray import serve

    from omnirl_core.contracts import GenRequest, RolloutPlan, Sample
    from omnirl_core.loop.executors import build_rewards
    from omnirl_core.loop.ray_serve_rewards import ServedRewards

    plan = RolloutPlan(step_kinds=("ode",), train_steps=())
    prompts = ["a red square", "a blue circle", "a green field", "a white wall"]
    samples = [Sample(request=GenRequest(uid=i, prompt=prompts[i % 4], prompt_index=i % 4, group=i % 4, seed=i,
                                         height=8, width=8, plan=plan),
                      latents=None, sigmas=None, logprobs=None, output=torch.rand(3, 8, 8, generator=torch.Generator()
                                                                                  .manual_seed(i)))
               for i in range(8)]
    invariant = _resolved(tmp_path, **SERVE)
    varying = _resolved(tmp_path, rewards=[{"name": "faulty", "options": {"mode": "ok"}}], **SERVE)
    bundle = {"CPU": 0.5, "reward": 0.001}
    first = ServedRewards(invariant, bundle, "strict_spread", None)
    second = ServedRewards(varying, bundle, "pack", None)
    try:
        config = first.deployment_config()
        assert config["ray_actor_options"] == {"num_cpus": 0.5, "resources": {"reward": 0.001}}
        assert config["max_replicas_per_node"] == 1  # strict_spread: a node per replica
        assert config["autoscaling_config"]["min_replicas"] == 1 and config["autoscaling_config"]["max_replicas"] == 2
        assert config["autoscaling_config"]["target_ongoing_requests"] == 4
        first.deploy()
        second.deploy()
        assert first.started_serve and not second.started_serve
        refs = [ray.put(s) for s in samples]
        got = first.results([first.send(r) for r in refs], lambda: None)
        alone = build_rewards(invariant)
        for sample in samples:
            alone.score([sample])
        assert [g[0][0] for g in got] == [(s.rewards, s.reward) for s in samples]
        settings = first.replica_settings()
        assert settings["batched"] and settings["max_batch_size"] == 4
        assert sum(settings["batch_sizes"]) == 8 and max(settings["batch_sizes"]) > 1
        assert max(settings["batch_sizes"]) <= 4
        second.results([second.send(r) for r in refs], lambda: None)
        settings = second.replica_settings()
        assert not settings["batched"] and settings["batch_sizes"] == []
        second.close()
        assert _serve_running() and first.app in serve.status().applications  # only its own application went
        assert second.app not in serve.status().applications
    finally:
        second.close()
        first.close()
    assert not _serve_running()


def test_a_required_reward_that_fails_in_a_replica_stops_the_run_with_its_name(ray_cluster, tmp_path: Path):
    with pytest.raises(RewardError, match="Required reward 'faulty' failed on 1 sample") as err:
        _run(tmp_path, rewards=[{"name": "faulty", "options": {"mode": "raise"}}], steps=1, **SERVE)
    assert "the scorer crashed" in str(err.value)
    assert not _serve_running()  # shut down on the failure too


def test_serving_needs_the_ray_executor(tmp_path: Path):
    with pytest.raises(ConfigError) as err:
        _resolved(tmp_path, executor="inline", reward_serving="serve")
    assert "run.reward_serving" in err.value.render() and "needs run.executor=ray" in err.value.render()
    with pytest.raises(ConfigError) as err:
        _resolved(tmp_path, reward_serving="serve", reward_serve={"max_batch_size": 64, "max_ongoing_requests": 8})
    assert "run.reward_serve.max_batch_size" in err.value.render()
    assert "64 is more than max_ongoing_requests (8)" in err.value.render()


def test_without_ray_serve_the_option_says_what_to_install(monkeypatch):
    from omnirl_core.errors import UsageError
    from omnirl_core.loop.ray_executor import served_rewards

    monkeypatch.setitem(sys.modules, "omnirl_core.loop.ray_serve_rewards", None)  # as if ray.serve failed to import
    with pytest.raises(UsageError, match="needs Ray Serve") as err:
        served_rewards()
    assert 'pip install "ray[serve]"' in err.value.render() and err.value.exit_code == 2


def test_the_deployment_adds_a_replica_while_requests_queue(ray_cluster, tmp_path: Path):
    """Autoscaling observed, not only configured: a slow reward (0.3 s a call, never batched) with 1..2 replicas
    and a target of 1 request in flight per replica gains its second replica while requests keep queueing, and
    every request is answered."""
    import time

    from ray import serve

    from omnirl_core.loop.ray_serve_rewards import DEPLOYMENT, ServedRewards

    scaling = {**SERVE, "reward_serve": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                                         "max_batch_size": 1, "max_ongoing_requests": 2, "upscale_delay_s": 0.0}}
    resolved = _resolved(tmp_path, rewards=[{"name": "faulty", "options": {"mode": "slow", "delay_s": 0.3}}],
                         **scaling)
    served = ServedRewards(resolved, {"CPU": 0.5, "reward": 0.001}, "pack", None)
    try:
        served.deploy()
        sample = _one_sample()
        ref = ray.put(sample)
        pending, replicas, deadline = [], 1, time.monotonic() + 90.0
        while replicas < 2 and time.monotonic() < deadline:
            pending += [served.send(ref) for _ in range(4)]  # more than the replicas can take: the queue grows
            time.sleep(0.5)
            states = serve.status().applications[served.app].deployments[DEPLOYMENT].replica_states
            replicas = int(states.get("RUNNING", 0))
        assert replicas == 2, f"no second replica within 90 s of queued requests ({states})"
        answers = served.results(pending, lambda: None)
        assert len(answers) == len(pending)
    finally:
        served.close()


def _one_sample():
    import torch

    from omnirl_core.contracts import GenRequest, RolloutPlan, Sample

    plan = RolloutPlan(step_kinds=("ode",), train_steps=())
    return Sample(request=GenRequest(uid=0, prompt="a red square", prompt_index=0, group=0, seed=0, height=8,
                                     width=8, plan=plan),
                  latents=None, sigmas=None, logprobs=None, output=torch.rand(3, 8, 8))
