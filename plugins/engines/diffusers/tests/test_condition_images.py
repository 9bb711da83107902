"""The rollout engine with an image-conditioned model (the core's ``ToyEditModel``): requests whose source images
differ in size never share a model call (their condition tokens are concatenated to the sequence, not padded), a
group's source is encoded once and shared, and the trainer re-evaluates every sample with the rollout's conditioning
(log-probs within 1e-5 across re-batching, and bit for bit where it batches as the rollout did)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omnirl_plugin_diffusers.engine import DiffusersRolloutEngine, DiffusersRolloutOptions

from omnirl_core.config import LoraConfig
from omnirl_core.contracts import GenRequest, RolloutPlan
from omnirl_core.flow.policy_gradient import Transition, transition_stats

PLAN = RolloutPlan(step_kinds=("sde", "sde", "ode"), train_steps=(0, 1), eta=0.8)
SOURCE_SIZES = {"square": (32, 32), "wide": (64, 16), "tall": (16, 64)}  # three latent grids, same token count


@pytest.fixture(scope="module")
def model():
    from omnirl_core.testing.flow_toy import ToyEditModel

    m = ToyEditModel()
    m.setup_training(LoraConfig(rank=4, alpha=4), need_reference=False)
    return m


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    from omnirl_core.testing import write_sources

    return dict(zip(SOURCE_SIZES, write_sources(tmp_path_factory.mktemp("sources"), list(SOURCE_SIZES.values()))))


def _requests(sources: dict[str, str], group_size: int = 2, guidance: float = 1.0) -> list[GenRequest]:
    """Groups of ``group_size`` per (instruction, source), every source size in the mix, and a text-only group."""
    groups = [("make it red", sources["square"]), ("make it blue", sources["wide"]), ("paint it", sources["tall"]),
              ("make it green", sources["square"]), ("a plain prompt", None)]
    out = []
    for g, (prompt, source) in enumerate(groups):
        for k in range(group_size):
            uid = g * group_size + k
            out.append(GenRequest(uid=uid, prompt=prompt, prompt_index=g, group=g, seed=100 + 7 * uid, height=32,
                                  width=32, plan=PLAN, guidance_scale=guidance,
                                  inputs={"image": source} if source else {}))
    return out


def _run(model, requests, **options):
    engine = DiffusersRolloutEngine(model, DiffusersRolloutOptions(**options), "cpu")
    calls = []
    velocity = model.velocity

    def recording(latents, sigma, cond, guidance_scale=1.0, uncond=None):
        calls.append((len(cond), cond.layout))
        return velocity(latents, sigma, cond, guidance_scale, uncond)

    model.velocity = recording
    try:
        samples = {s.request.uid: s for s in engine.generate(requests)}
    finally:
        del model.velocity
    return samples, calls, engine


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_different_source_sizes_never_share_a_call(model, sources, guidance: float):
    requests = _requests(sources, guidance=guidance)
    samples, calls, engine = _run(model, requests, max_num_seqs=32)
    layouts = {r.uid: model.condition_key(r) for r in requests}
    assert {layouts[u] for u in layouts} == {((4, 4),), ((2, 8),), ((8, 2),), None}
    # every call holds one layout (cat refuses two), and each of the four layouts ran on its own
    assert {layout for _, layout in calls} == set(layouts.values())
    assert len(calls) == 4 * PLAN.num_steps and sum(n for n, _ in calls) == len(requests) * PLAN.num_steps
    for uid, sample in samples.items():
        assert sample.cond.layout == layouts[uid]
        assert ("image_latents" in sample.cond.tensors) == (layouts[uid] is not None)
        if guidance > 1.0:  # the negative prompt is encoded with the same source
            assert sample.uncond.layout == layouts[uid]
    # a group's source is encoded once and shared by its samples
    assert samples[0].cond is samples[1].cond and samples[0].cond is not samples[6].cond
    assert engine.stats.summary()["encode_prompts"] == 5 + (4 if guidance > 1.0 else 0)


def test_a_sample_does_not_depend_on_what_shared_its_batches(model, sources):
    requests = _requests(sources)
    together, _, _ = _run(model, requests, max_num_seqs=32)
    single, _, _ = _run(model, requests, mode="single")
    for uid, sample in together.items():
        torch.testing.assert_close(sample.latents, single[uid].latents, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sample.logprobs, single[uid].logprobs, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_the_trainer_recomputes_the_rollouts_log_probs(model, sources, guidance: float):
    """Re-batched freely (micro-batches of mixed layouts run one call per layout): within 1e-5. Batched as the
    rollout batched them (one layout's samples at one step): bit for bit."""
    samples, _, _ = _run(model, _requests(sources, guidance=guidance), max_num_seqs=32)
    units = [Transition(s, j) for s in samples.values() for j in PLAN.train_steps]
    with torch.no_grad():
        for start in range(0, len(units), 7):
            chunk = units[start:start + 7][::-1]
            logp = transition_stats(model, chunk, PLAN.eta)[2]
            torch.testing.assert_close(logp, torch.stack([u.rollout_logprob for u in chunk]), atol=1e-5, rtol=0)
        by_layout: dict[object, list] = {}
        for s in sorted(samples.values(), key=lambda s: s.request.uid):
            by_layout.setdefault(s.cond.layout, []).append(s)
        for group in by_layout.values():
            for j in PLAN.train_steps:
                logp = transition_stats(model, [Transition(s, j) for s in group], PLAN.eta)[2]
                assert torch.equal(logp, torch.stack([s.logprobs[j] for s in group]))


def test_a_missing_source_fails_the_request_clearly(model, tmp_path: Path):
    request = _requests({"square": str(tmp_path / "gone.png"), "wide": str(tmp_path / "gone.png"),
                         "tall": str(tmp_path / "gone.png")})[:1]
    with pytest.raises(FileNotFoundError, match="gone.png"):
        _run(model, request)
