"""The rollout engine on the core's toy flow model (random weights, CPU, fp32): batch invariance across
modes and mixed shapes, the trainer's re-evaluation, streaming, fairness, arrivals and the embedding cache."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from omnirl_plugin_diffusers.engine import DiffusersRolloutEngine, DiffusersRolloutOptions

from omnirl_core.config import LoraConfig, RunConfig
from omnirl_core.contracts import GenRequest, RolloutPlan, Sample
from omnirl_core.errors import UsageError
from omnirl_core.flow.policy_gradient import FlowPolicyGradient

PROMPTS = ["a red square", "a blue square on a long green field under a grey sky", "cat"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The CPUs are shared: one intra-op thread keeps these timings (and the arrival test) steady."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    from omnirl_core.testing.flow_toy import ToyFlowModel

    m = ToyFlowModel()
    # as in training: a LoRA adapter on the denoiser (zero-initialised, so outputs are the base model's)
    m.setup_training(LoraConfig(rank=4, alpha=4), need_reference=False)
    return m


def plan(steps: int, kind: str = "sde", eta: float = 0.8) -> RolloutPlan:
    return RolloutPlan(step_kinds=(kind,) * (steps - 1) + ("ode",), train_steps=tuple(range(steps - 1)), eta=eta)


def request(uid: int, size: int = 32, steps: int = 3, guidance: float = 1.0, arrival: float = 0.0,
            kind: str = "sde", prompt: str | None = None) -> GenRequest:
    return GenRequest(uid=uid, prompt=prompt or PROMPTS[uid % len(PROMPTS)], prompt_index=uid % len(PROMPTS),
                      group=uid % len(PROMPTS), seed=1000 + 7 * uid, height=size, width=size,
                      plan=plan(steps, kind), guidance_scale=guidance, arrival_s=arrival)


def mixed_workload() -> list[GenRequest]:
    """Three latent shapes, CFG on and off, 2-5 steps, SDE and CPS plans, staggered arrivals."""
    specs = [(32, 3, 1.0, "sde"), (48, 2, 4.0, "sde"), (32, 5, 1.0, "cps"), (64, 3, 1.0, "sde"),
             (32, 2, 4.0, "sde"), (48, 4, 1.0, "sde"), (32, 4, 1.0, "sde"), (64, 2, 4.0, "cps"),
             (32, 3, 4.0, "sde"), (48, 3, 1.0, "sde")]
    return [request(i, size, steps, guidance, arrival=0.004 * i, kind=kind)
            for i, (size, steps, guidance, kind) in enumerate(specs)]


def run(model, requests, **options) -> tuple[dict[int, Sample], DiffusersRolloutEngine]:
    engine = DiffusersRolloutEngine(model, DiffusersRolloutOptions(**options), "cpu")
    return {s.request.uid: s for s in engine.generate(requests)}, engine


def assert_same_samples(a: dict[int, Sample], b: dict[int, Sample]) -> None:
    assert a.keys() == b.keys()
    for uid, sample in a.items():
        torch.testing.assert_close(sample.latents, b[uid].latents, atol=1e-5, rtol=0)
        la, lb = sample.logprobs, b[uid].logprobs
        assert torch.equal(la.isnan(), lb.isnan())
        torch.testing.assert_close(la.nan_to_num(), lb.nan_to_num(), atol=1e-5, rtol=0)


def test_batch_invariance_across_modes_and_mixed_shapes(model):
    """A sample's latents and log-probs are the same alone, in static batches and in step-wise batches
    shared with other shapes, CFG scales, step counts and samplers."""
    work = mixed_workload()
    alone = {}
    for r in work:  # each request on its own, in a fresh engine with no cache: the reference
        alone.update(run(model, [r], mode="single", embedding_cache_size=0)[0])
    step, engine = run(model, work, mode="step", max_num_seqs=3)
    request_level, _ = run(model, work, mode="request", max_num_seqs=3)
    single, _ = run(model, work, mode="single")
    # the step-wise run really did mix: batches of several requests at different steps and sigmas
    assert engine.stats.model_calls < sum(r.plan.num_steps for r in work)
    for other in (step, request_level, single):
        assert_same_samples(alone, other)
    for uid, s in step.items():
        r = work[uid]
        assert s.latents.shape == (r.plan.num_steps + 1, 4, r.height // 4, r.width // 4)
        assert s.logprobs[:-1].isfinite().all() and s.logprobs[-1].isnan()
        assert s.output.shape == (3, r.height, r.width)


def test_different_seeds_give_different_samples(model):
    a, _ = run(model, [request(0)])
    other = request(0)
    other.seed += 1
    b, _ = run(model, [other])
    assert (a[0].latents[-1] - b[0].latents[-1]).abs().max() > 1e-2


def test_trainer_reevaluation_matches_step_wise_rollout(model):
    """FlowPolicyGradient.prepare (recompute) re-evaluates every trained transition with the trainer's
    own micro-batches; with unchanged weights it reproduces the rollout's log-probs."""
    samples = list(run(model, mixed_workload(), mode="step", max_num_seqs=3)[0].values())
    config = RunConfig()
    options = type("Options", (), {"beta": 0.0, "global_std": True, "adv_clip": 5.0, "clip_range": 1e-4})()
    algo = FlowPolicyGradient(options, config)
    assert algo.recompute
    units = algo.training_units(samples)
    # the trainer stacks transitions of one latent shape, CFG scale, sampler and eta per call
    groups: dict[tuple, list] = {}
    for u in units:
        r = u.sample.request
        groups.setdefault((r.height, r.guidance_scale, u.kind, r.plan.eta), []).append(u)
    assert len(groups) >= 5
    with torch.no_grad():
        for group in groups.values():
            metrics = algo.prepare(model, group)
            assert metrics["logprob/abs_delta_max"] < 1e-5
    for u in units:
        assert abs(float(u.old_logprob) - float(u.rollout_logprob)) < 1e-5


def test_step_mode_streams_each_sample_as_soon_as_it_is_done(model):
    requests = [request(0, steps=6), request(1, steps=2), request(2, steps=4)]
    engine = DiffusersRolloutEngine(model, DiffusersRolloutOptions(mode="step"), "cpu")
    seen = []
    for sample in engine.generate(requests):
        seen.append((sample.request.uid, engine.stats.model_calls))
    # out of submission order, each handed out right after its own last step
    assert seen == [(1, 2), (2, 4), (0, 6)]
    engine = DiffusersRolloutEngine(model, DiffusersRolloutOptions(mode="request"), "cpu")
    static = [(s.request.uid, engine.stats.model_calls) for s in engine.generate(requests)]
    assert static == [(0, 6), (1, 6), (2, 6)]  # a static batch is returned as a whole
    assert engine.stats.padding_rows == (6 - 2) + (6 - 4)


def test_decode_batch_decodes_finished_requests_together(model):
    """decode_batch=3: requests finishing at model calls 2, 4 and 6 are held until the third has finished, then
    decoded in one VAE call; the same samples as when each is decoded on its own (up to batched-call rounding)."""
    requests = [request(0, steps=6), request(1, steps=2), request(2, steps=4)]
    engine = DiffusersRolloutEngine(model, DiffusersRolloutOptions(mode="step", decode_batch=3), "cpu")
    held = {s.request.uid: (s, engine.stats.model_calls) for s in engine.generate(requests)}
    assert [calls for _, calls in held.values()] == [6, 6, 6] and engine.stats.decode_calls == 1
    engine = DiffusersRolloutEngine(model, DiffusersRolloutOptions(mode="step"), "cpu")
    streamed = {s.request.uid: s for s in engine.generate(requests)}
    assert engine.stats.decode_calls == 3
    for uid, (sample, _) in held.items():
        assert torch.equal(sample.latents, streamed[uid].latents)
        torch.testing.assert_close(sample.output, streamed[uid].output, rtol=0, atol=1e-4)


def test_a_sample_decoded_with_others_owns_its_tensors(model):
    """A sample's tensors are its own, not rows of the batch they were decoded in: a row would carry the whole
    batch's storage wherever the sample is pickled (to a Ray actor, 32x its size at a decode batch of 32)."""
    import pickle

    requests = [request(uid, steps=3) for uid in range(4)]
    engine = DiffusersRolloutEngine(model, DiffusersRolloutOptions(mode="step", decode_batch=4), "cpu")
    samples = list(engine.generate(requests))
    assert engine.stats.decode_calls == 1
    for sample in samples:
        tensors = [sample.latents, sample.sigmas, sample.logprobs, sample.output,
                   *(t for c in sample.extras.values() if c is not None for t in c.tensors.values())]
        for t in tensors:
            assert t.untyped_storage().nbytes() == t.nbytes
        assert len(pickle.dumps(sample)) < 1.2 * sum(t.nbytes for t in tensors) + 4096


def test_auto_decode_batch_holds_finished_requests_only_while_others_queue(model):
    """decode_batch 'auto' (the default): with 2 slots and 4 requests, A (2 steps) and C (2 steps) finish while
    D still queues and are held; once D has a slot nothing queues, and they are decoded together after the next
    call; B (6 steps) and D finish together. With 1, each finished request is decoded at once (3 calls). An RL
    wave that fits streams (test_step_mode_streams_each_sample_as_soon_as_it_is_done)."""
    requests = [request(0, steps=2), request(1, steps=6), request(2, steps=2), request(3, steps=2)]
    engine = DiffusersRolloutEngine(model, DiffusersRolloutOptions(mode="step", max_num_seqs=2), "cpu")
    auto = [(s.request.uid, engine.stats.model_calls) for s in engine.generate(requests)]
    assert sorted(auto) == [(0, 5), (1, 6), (2, 5), (3, 6)] and engine.stats.decode_calls == 2
    engine = DiffusersRolloutEngine(model, DiffusersRolloutOptions(mode="step", max_num_seqs=2, decode_batch=1), "cpu")
    streamed = [(s.request.uid, engine.stats.model_calls) for s in engine.generate(requests)]
    assert streamed[:2] == [(0, 2), (2, 4)] and engine.stats.decode_calls == 3


def test_a_lone_shape_is_not_stuck_behind_a_crowded_one(model):
    crowd = [request(i, size=32, steps=3) for i in range(8)]
    lone = request(8, size=64, steps=3)
    order = {}
    for mode in ("step", "request"):
        # decode_batch 1: the hand-out order is the finishing order ('auto' holds finished ones while others queue)
        samples, _ = run(model, crowd + [lone], mode=mode, max_num_seqs=2, decode_batch=1)
        order[mode] = list(samples)
    # step-wise: the lone 64x64 request shares the turns and finishes with the first crowd batch
    assert order["step"].index(8) <= 2
    # request-level: it waits until every crowded batch ahead of it is done
    assert order["request"][-1] == 8


def test_arrival_times_and_submit_from_another_thread(model):
    engine = DiffusersRolloutEngine(model, DiffusersRolloutOptions(), "cpu")
    late = request(5, steps=2)

    def producer():
        time.sleep(0.05)
        engine.submit(late)

    thread = threading.Thread(target=producer)
    start = time.perf_counter()
    thread.start()
    # the late arrival is far enough out that the first request finishes before it even on a loaded machine
    samples = list(engine.generate([request(0, steps=2), request(1, steps=2, arrival=2.0)]))
    thread.join()
    assert sorted(s.request.uid for s in samples) == [0, 1, 5]
    assert [s.request.uid for s in samples][-1] == 1
    assert time.perf_counter() - start >= 2.0
    assert engine.stats.seconds["idle"] > 0  # it slept until the arrival instead of spinning
    # latency counts from the arrival, not from the call
    assert engine.stats.latencies[-1] < engine.stats.wall_s - 1.9


def test_memory_cap_limits_requests_in_flight(model):
    work = [request(i, size=32, steps=2) for i in range(4)]
    per_request_mib = 4 * 8 * 8 * 4 / 2**20
    capped, engine = run(model, work, max_latent_mib=2.5 * per_request_mib)
    assert engine.stats.max_active == 2
    assert_same_samples(capped, run(model, work)[0])
    with pytest.raises(UsageError, match="max_latent_mib"):
        run(model, [request(0, size=64)], max_latent_mib=per_request_mib)


def test_embedding_cache_encodes_each_prompt_once_and_shares_it(model):
    group = [request(i, prompt="a red square") for i in range(4)] + [request(4, prompt="cat", guidance=4.0)]
    engine = DiffusersRolloutEngine(model, DiffusersRolloutOptions(), "cpu")
    samples = list(engine.generate(group))
    # 'a red square', 'cat' and the negative prompt, each once
    assert engine.stats.encode["prompts"] == 3
    by_uid = {s.request.uid: s for s in samples}
    assert by_uid[0].cond is by_uid[3].cond  # the group shares one conditioning
    list(engine.generate(group))
    assert engine.stats.encode["prompts"] == 0 and engine.stats.encode["calls"] == 0
    model.text_encoder_version = 1  # the text encoder changed: stale embeddings must go
    try:
        list(engine.generate(group))
        assert engine.stats.encode["prompts"] == 3
    finally:
        del model.text_encoder_version
    uncached = DiffusersRolloutEngine(model, DiffusersRolloutOptions(embedding_cache_size=0), "cpu")
    list(uncached.generate(group))
    assert uncached.stats.encode["prompts"] == 6  # every request (and the negative prompt) on its own


def test_cached_conditioning_does_not_depend_on_the_other_prompts(model):
    from omnirl_core.flow.embedding_cache import EmbeddingCache

    together = EmbeddingCache(model).lookup(PROMPTS)
    for prompt, cond in zip(PROMPTS, together):
        alone = EmbeddingCache(model).lookup([prompt])[0]
        assert cond.tensors["prompt_embeds"].shape == alone.tensors["prompt_embeds"].shape
        assert bool(cond.tensors["prompt_mask"].all())
        torch.testing.assert_close(cond.tensors["prompt_embeds"], alone.tensors["prompt_embeds"], atol=1e-5, rtol=0)


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="mode"):
        DiffusersRolloutOptions(mode="dynamic")


@pytest.mark.parametrize("mode", ["step", "request"])
def test_the_rollout_engine_contract_suite(model, mode: str):
    """The core's rollout-engine suite: samples, trajectories, seeds and the trainer's re-evaluation."""
    from omnirl_core.testing.engines import check_rollout_engine

    samples = check_rollout_engine(
        lambda m: DiffusersRolloutEngine(m, DiffusersRolloutOptions(mode=mode, max_num_seqs=2), "cpu"), model=model)
    assert len(samples) == 6
