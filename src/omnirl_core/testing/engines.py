"""Contract suites every engine plugin's tests call: ``check_rollout_engine`` and ``check_train_engine``.

    from omnirl_core.testing.engines import check_rollout_engine, check_train_engine

    def test_rollout_contract():
        check_rollout_engine(lambda model: MyRolloutEngine(model, MyOptions(), "cpu"))

    def test_train_contract(tmp_path):
        check_train_engine(lambda model, train: MyTrainEngine(model, train, MyOptions(), "cpu"), directory=tmp_path)

Both run on the core's toy flow model (``flow_toy.ToyFlowModel``: real diffusers and transformers components with
random weights, true CFG) unless given another model, so that an engine's tests import no model plugin. The
rollout suite also takes a token model (``omnirl_core.contracts.TokenModel``) for the engines of AR models. Each
check raises AssertionError with what is wrong, and returns what it produced.
"""

from __future__ import annotations

import copy
import math
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from omnirl_core.config import TrainSection
    from omnirl_core.contracts import (
        Conditioning,
        FlowModel,
        GenRequest,
        PolicyModel,
        RolloutEngine,
        Sample,
        TokenModel,
        TrainEngine,
        TrainingUnit,
    )
    from omnirl_core.flow.policy_gradient import FlowPolicyGradientOptions, Transition

PROMPTS = ("a red square", "a blue car on a long street under a grey sky, photo", "cat")
"""Prompts of different lengths: their conditioning is padded (and masked) differently when batched."""

LOGPROB_ATOL = 1e-5
"""Rollout vs trainer log-probs (fp32, unchanged weights): the same numbers up to the rounding of batched calls."""


def toy_flow_model(seed: int = 0, lora: bool = True, need_reference: bool = True) -> FlowModel:
    """The suites' default model: ``ToyFlowModel`` set up for training as a run does (a LoRA adapter of rank 4,
    or the whole denoiser, and a reference policy), its adapter initialised from ``seed``; its trained weights
    save and load as a Qwen-Image pipeline's (its denoiser is Qwen-Image's transformer; the toy has no pipeline)."""
    import torch

    from omnirl_core.config import LoraConfig
    from omnirl_core.testing.flow_toy import ToyFlowModel

    class SavableToyFlowModel(ToyFlowModel):
        def save_trained(self, directory: Path, state: dict[str, torch.Tensor] | None = None) -> list[str]:
            if self.lora is None:  # the denoiser's save_pretrained: no pipeline needed
                return super().save_trained(directory, state)
            from diffusers import QwenImagePipeline
            from peft.utils import get_peft_model_state_dict

            directory.mkdir(parents=True, exist_ok=True)
            layers = state if state is not None else get_peft_model_state_dict(self.denoiser)
            QwenImagePipeline.save_lora_weights(save_directory=str(directory), transformer_lora_layers=layers,
                                                safe_serialization=True)
            return ["pytorch_lora_weights.safetensors"]

    model = SavableToyFlowModel(seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.setup_training(LoraConfig(enabled=lora, rank=4, alpha=4), need_reference=need_reference)
    return model


# -- rollout ---------------------------------------------------------------------------------------------

def check_rollout_engine(build_engine: Callable[[Any], RolloutEngine], model: PolicyModel | None = None, *,
                         height: int = 32, width: int = 32, num_frames: int | None = None, num_steps: int = 3,
                         eta: float = 0.7, guidance_scale: float = 4.0, prompts: Sequence[str] = PROMPTS,
                         logprob_atol: float = LOGPROB_ATOL) -> list[Sample]:
    """The rollout-engine contract (``omnirl_core.contracts.RolloutEngine``) on ``model`` (default: the toy flow
    model). ``build_engine(model)`` returns the engine, as its spec's factory would with the plugin's options and
    device. Dispatches on the model's kind: ``check_flow_rollout`` or ``check_token_rollout``. Returns the
    samples of the first ``generate`` call, in request order."""
    from omnirl_core.contracts import FlowModel, TokenModel

    model = toy_flow_model() if model is None else model
    if isinstance(model, TokenModel):
        return check_token_rollout(build_engine, model, prompts=prompts, logprob_atol=logprob_atol)
    assert isinstance(model, FlowModel), f"{type(model).__name__} is neither a FlowModel nor a TokenModel"
    return check_flow_rollout(build_engine, model, height=height, width=width, num_frames=num_frames,
                              num_steps=num_steps, eta=eta, guidance_scale=guidance_scale, prompts=prompts,
                              logprob_atol=logprob_atol)


def _generate(engine: RolloutEngine, requests: list[GenRequest]) -> list[Sample]:
    """Every request's sample, in request order: exactly one each, with the request attached (any order out)."""
    samples = list(engine.generate([copy.deepcopy(r) for r in requests]))
    uids = [s.request.uid for s in samples]
    assert sorted(uids) == sorted(r.uid for r in requests), \
        f"generate must yield one sample per request: got uids {uids} for {[r.uid for r in requests]}"
    by_uid = {s.request.uid: s for s in samples}
    for r in requests:
        assert by_uid[r.uid].request == r, f"sample {r.uid} carries another request: {by_uid[r.uid].request}"
    return [by_uid[r.uid] for r in requests]


def _tensor(value: object, what: str) -> torch.Tensor:
    """``value``, which must be a tensor (a trajectory field of the sample's kind)."""
    import torch

    assert isinstance(value, torch.Tensor), f"{what} is {type(value).__name__}, not a tensor"
    return value


def _same_conditioning(stored: Conditioning | None, fresh: Conditioning, what: str) -> None:
    """``stored`` (one row, possibly padded or trimmed differently) holds the tensors of ``fresh``: equal where both
    have positions, zeros ("not a token") where only one has them."""
    import torch

    from omnirl_core.contracts import Conditioning

    assert isinstance(stored, Conditioning) and len(stored) == 1, f"{what}: not a one-row Conditioning: {stored}"
    assert stored.tensors.keys() == fresh.tensors.keys(), (what, sorted(stored.tensors), sorted(fresh.tensors))
    for key, value in stored.tensors.items():
        a, b = value.detach().float().cpu(), fresh.tensors[key].detach().float().cpu()
        if key in fresh.pad_keys and a.shape[1] != b.shape[1]:
            n = min(a.shape[1], b.shape[1])
            longer = a if a.shape[1] > n else b
            assert bool((longer[:, n:] == 0).all()), f"{what}: '{key}' differs beyond the shorter one's positions"
            a, b = a[:, :n], b[:, :n]
        assert a.shape == b.shape, f"{what}: '{key}' has shape {tuple(a.shape)}, the prompt's is {tuple(b.shape)}"
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, key=key: f"{what}: '{key}': {m}")  # type: ignore[misc, unused-ignore]  # mypy: lambda default


def _flow_requests(prompts: Sequence[str], height: int, width: int, num_frames: int | None, num_steps: int,
                   eta: float, guidance_scale: float) -> list[GenRequest]:
    """Two plans (Flow-SDE and CPS on all but the last step, an ODE last step), two latent shapes, guided and
    unguided requests, prompts of different lengths, two samples of one prompt with different seeds."""
    from omnirl_core.contracts import GenRequest, RolloutPlan

    stochastic = tuple(range(num_steps - 1))
    sde = RolloutPlan(step_kinds=("sde",) * (num_steps - 1) + ("ode",), train_steps=stochastic, eta=eta)
    cps = RolloutPlan(step_kinds=("cps",) * (num_steps - 1) + ("ode",), train_steps=stochastic, eta=eta)
    g = guidance_scale
    # (prompt, group, seed, guidance, plan, width)
    specs = [(0, 0, 11, 1.0, sde, width), (0, 0, 12, 1.0, sde, width), (1, 1, 13, g, sde, width),
             (2, 2, 14, g, cps, width), (1, 1, 15, 1.0, cps, 2 * width), (2, 2, 16, g, sde, 2 * width)]
    return [GenRequest(uid=uid, prompt=prompts[p % len(prompts)], prompt_index=p % len(prompts), group=group,
                       seed=1000 + seed, height=height, width=w, num_frames=num_frames, plan=plan, guidance_scale=scale)
            for uid, (p, group, seed, scale, plan, w) in enumerate(specs)]


def check_flow_rollout(build_engine: Callable[[FlowModel], RolloutEngine], model: FlowModel, *, height: int = 32,
                       width: int = 32, num_frames: int | None = None, num_steps: int = 3, eta: float = 0.7,
                       guidance_scale: float = 4.0, prompts: Sequence[str] = PROMPTS,
                       logprob_atol: float = LOGPROB_ATOL) -> list[Sample]:
    """A flow model's rollout engine: one sample per request with its request (any order); outputs of the
    request's size in [0, 1], the decoding of the final latent; the trajectory (latents (T + 1, *latent_shape),
    the model's sigmas for the plan, log-probs finite on the trained steps and NaN on
    the ODE steps, ``cond`` the request's prompt, ``uncond`` set exactly when the request is guided with true
    CFG); reproducible per request whatever shares its batch; different seeds, different samples; and the
    trainer's re-evaluation of every trained transition (``transition_stats``, micro-batches unlike the
    rollout's) equals the rollout's log-prob to ``logprob_atol``."""
    import torch

    from omnirl_core.contracts import RolloutEngine
    from omnirl_core.flow.policy_gradient import Transition, transition_stats

    engine = build_engine(model)
    assert isinstance(engine, RolloutEngine), \
        f"{type(engine).__name__} is not an omnirl_core.contracts.RolloutEngine"
    true_cfg = model.guidance == "cfg"
    scale = guidance_scale if model.guidance != "none" else 1.0
    requests = _flow_requests(prompts, height, width, num_frames, num_steps, eta, scale)
    try:
        samples = _generate(engine, requests)
        again = {s.request.uid: s for s in _generate(engine, [requests[3]])}
        again.update({s.request.uid: s for s in _generate(engine, [requests[5], requests[0]])})
    finally:
        engine.close()

    for r, s in zip(requests, samples):
        what = f"sample {r.uid} ({r.plan.step_kinds}, guidance {r.guidance_scale:g}, {r.height}x{r.width})"
        shape = tuple(model.latent_shape(r.height, r.width, r.num_frames))
        out = s.output
        assert torch.is_tensor(out) and out.is_floating_point(), f"{what}: output is not a float tensor"
        expected = (3, r.height, r.width) if r.num_frames is None else (3, r.num_frames, r.height, r.width)
        assert tuple(out.shape) == expected, f"{what}: output shape {tuple(out.shape)}, expected {expected}"
        assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0, f"{what}: output outside [0, 1]"
        latents = _tensor(s.latents, f"{what}: latents")
        sigmas = _tensor(s.sigmas, f"{what}: sigmas")
        logprobs = _tensor(s.logprobs, f"{what}: log-probs")
        assert latents.dtype == torch.float32 and tuple(latents.shape) == (r.plan.num_steps + 1, *shape), \
            f"{what}: latents {latents.dtype} {tuple(latents.shape)}, expected fp32 {(r.plan.num_steps + 1, *shape)}"
        assert bool(torch.isfinite(latents).all()), f"{what}: non-finite latents"
        schedule = r.plan.sigmas_from(model.sigmas(r.plan.schedule_steps, shape)).float().cpu()
        assert sigmas.dtype == torch.float32 and tuple(sigmas.shape) == (r.plan.num_steps + 1,), f"{what}: {sigmas}"
        torch.testing.assert_close(sigmas.cpu(), schedule, atol=1e-6, rtol=0,
                                   msg=lambda m, what=what: f"{what}: not the model's schedule: {m}")  # type: ignore[misc, unused-ignore]  # mypy: lambda default
        assert tuple(logprobs.shape) == (r.plan.num_steps,), f"{what}: log-probs of shape {tuple(logprobs.shape)}"
        for j, kind in enumerate(r.plan.step_kinds):
            value = float(logprobs[j])
            if j in r.plan.train_steps:
                assert math.isfinite(value), f"{what}: log-prob of trained step {j} is {value}"
            elif kind in ("ode", "dpm2"):
                assert math.isnan(value), f"{what}: the ODE step {j} has a log-prob ({value}); it must be NaN"
        _same_conditioning(s.cond, model.encode([r.prompt]), f"{what}: cond")
        if r.guidance_scale <= 1.0:
            assert s.uncond is None, f"{what}: uncond set on an unguided sample"
        elif true_cfg:
            assert s.uncond is not None, f"{what}: a true-CFG sample without its unconditional conditioning"
            _same_conditioning(s.uncond, model.encode([model.negative_prompt]), f"{what}: uncond")
        decoded = model.decode(latents[-1:].to(model.device))[0].float().cpu()
        torch.testing.assert_close(out.float().cpu(), decoded, atol=1e-4, rtol=0,
                                   msg=lambda m, what=what: f"{what}: the output is not its final latent decoded: {m}")  # type: ignore[misc, unused-ignore]  # mypy: lambda default

    for uid, s in again.items():  # the same request again, in other company: the same sample
        first = samples[uid]
        torch.testing.assert_close(s.latents, first.latents, atol=1e-5, rtol=0,
                                   msg=lambda m, uid=uid: f"sample {uid} generated twice differs: {m}")  # type: ignore[misc, unused-ignore]  # mypy: lambda default
        lp, first_lp = _tensor(s.logprobs, f"sample {uid}: log-probs"), _tensor(first.logprobs, "log-probs")
        assert torch.equal(lp.isnan(), first_lp.isnan())
        torch.testing.assert_close(lp.nan_to_num(), first_lp.nan_to_num(), atol=logprob_atol, rtol=0)
        torch.testing.assert_close(s.output, first.output, atol=1e-4, rtol=0)
    # uids 0 and 1: one prompt, two seeds
    last = [_tensor(samples[i].latents, "latents")[-1] for i in (0, 1)]
    assert float((last[0] - last[1]).abs().max()) > 1e-3, \
        "two seeds of one prompt gave the same sample: the request's seed is not used"

    units = [Transition(s, j) for s in samples for j in s.request.plan.train_steps]
    groups: dict[tuple[int, int, float, str, float], list[Transition]] = {}
    for u in units:  # the trainer's calls: one latent shape, guidance scale, sampler and eta each
        r = u.sample.request
        groups.setdefault((r.height, r.width, r.guidance_scale, u.kind, r.plan.eta), []).append(u)
    worst = 0.0
    with torch.no_grad():
        for group in groups.values():
            group = group[::2] + group[1::2]  # micro-batches that mix samples and steps unlike the rollout's
            for start in range(0, len(group), 3):
                chunk = group[start:start + 3]
                logp = transition_stats(model, chunk, chunk[0].sample.request.plan.eta)[2].float().cpu()
                stored = torch.stack([u.rollout_logprob for u in chunk]).float().cpu()
                worst = max(worst, float((logp - stored).abs().max()))
    assert worst <= logprob_atol, f"the trainer's log-probs differ from the rollout's by {worst} (> {logprob_atol})"
    return samples


def check_token_rollout(build_engine: Callable[[TokenModel], RolloutEngine], model: TokenModel, *,
                        prompts: Sequence[str] = PROMPTS, group_size: int = 2,
                        logprob_atol: float = LOGPROB_ATOL) -> list[Sample]:
    """A token model's rollout engine: one sample per request with its request (any order); the trajectory of
    its kind (``prompt_tokens`` the request's prompt, ``completion`` 1-D token ids within the sampling's
    ``max_new_tokens``, ``sampling``, one finite log-prob <= 0 per token, no latents) and the text the completion
    decodes to; reproducible per request whatever shares its batch; different seeds, different completions; and
    the model's re-scoring (``token_logprobs``, in another batch order) equals the sampled log-probs to
    ``logprob_atol``."""
    import torch

    from omnirl_core.ar.policy_gradient import AR_PLAN
    from omnirl_core.ar.sampling import SamplingParams, TokenPrompt
    from omnirl_core.contracts import GenRequest, RolloutEngine

    engine = build_engine(model)
    assert isinstance(engine, RolloutEngine), \
        f"{type(engine).__name__} is not an omnirl_core.contracts.RolloutEngine"
    requests = [GenRequest(uid=p * group_size + k, prompt=text, prompt_index=p, group=p, seed=1000 + 7 * p + k,
                           height=0, width=0, plan=AR_PLAN)
                for p, text in enumerate(prompts) for k in range(group_size)]
    try:
        samples = _generate(engine, requests)
        again = {s.request.uid: s for s in _generate(engine, [requests[-1], requests[1]])}
    finally:
        engine.close()
    trajectories: dict[int, tuple[TokenPrompt, torch.Tensor, SamplingParams, torch.Tensor]] = {}
    for r, s in zip(requests, samples):
        what = f"sample {r.uid}"
        assert s.latents is None and s.sigmas is None, f"{what}: a token sample with latents or sigmas"
        assert isinstance(s.prompt_tokens, TokenPrompt), f"{what}: prompt_tokens is {type(s.prompt_tokens)}"
        assert torch.equal(s.prompt_tokens.input_ids.cpu(), model.encode_prompt(r).input_ids.cpu()), \
            f"{what}: prompt_tokens are not the request's prompt"
        assert isinstance(s.sampling, SamplingParams), f"{what}: sampling is {type(s.sampling)}"
        c = _tensor(s.completion, f"{what}: completion")
        assert c.dtype == torch.long and c.dim() == 1, f"{what}: completion {c}"
        assert 1 <= len(c) <= s.sampling.max_new_tokens, f"{what}: {len(c)} tokens"
        lp = _tensor(s.logprobs, f"{what}: log-probs")
        assert lp.dtype == torch.float32 and lp.shape == c.shape, f"{what}: log-probs {lp.dtype} {tuple(lp.shape)}"
        assert bool(torch.isfinite(lp).all()) and bool(lp.le(0).all()), f"{what}: log-probs {lp}"
        assert s.output == model.decode(c), f"{what}: the output is not the completion's text"
        trajectories[r.uid] = (s.prompt_tokens, c, s.sampling, lp)
    for uid, s in again.items():
        assert torch.equal(_tensor(s.completion, "completion"), trajectories[uid][1]), \
            f"sample {uid} generated twice differs"
        torch.testing.assert_close(s.logprobs, trajectories[uid][3], atol=logprob_atol, rtol=0)
    pairs = [(requests[i].uid, requests[i + 1].uid) for i in range(0, len(requests) - 1, group_size)]
    assert any(not torch.equal(trajectories[a][1], trajectories[b][1]) for a, b in pairs), \
        "every prompt's samples are the same: the request's seed is not used"
    order = [trajectories[r.uid] for r in reversed(requests)]
    with torch.no_grad():
        rescored = model.token_logprobs([t[0] for t in order], [t[1] for t in order], [t[2] for t in order])
    worst = max(float((a.float().cpu() - t[3]).abs().max()) for a, t in zip(rescored, order))
    assert worst <= logprob_atol, f"the trainer's log-probs differ from the sampled ones by {worst} (> {logprob_atol})"
    return samples


# -- train -----------------------------------------------------------------------------------------------

def _algorithm_class() -> type:
    """FlowGRPO's structure (``FlowPolicyGradient``): Flow-SDE on every step but the last, all of them trained."""
    from omnirl_core.contracts import RolloutPlan
    from omnirl_core.flow.policy_gradient import FlowPolicyGradient

    class SmallFlowGRPO(FlowPolicyGradient):
        def plan(self, step: int) -> RolloutPlan:
            n = self.num_steps
            return RolloutPlan(step_kinds=("sde",) * (n - 1) + ("ode",), train_steps=tuple(range(n - 1)),
                               eta=self.options.noise_level)

    return SmallFlowGRPO


def _token_algorithm_class() -> type:
    """GSPO's structure (``TokenPolicyGradient``): the clipped, length-normalised sequence ratio."""
    import torch

    from omnirl_core.ar.policy_gradient import TokenPolicyGradient, masked_mean

    class SmallGSPO(TokenPolicyGradient):
        def surrogate(self, logp, old, mask, adv):
            ratio = torch.exp(masked_mean(logp - old, mask))
            low, high = 1.0 - self.options.clip_range, 1.0 + self.options.clip_range
            return torch.maximum(-adv * ratio, -adv * ratio.clamp(low, high)), {}

    return SmallGSPO


def _options(beta: float) -> FlowPolicyGradientOptions:
    """The five options the policy-gradient base classes read (the token one reads the same names)."""
    from omnirl_core.flow.policy_gradient import FlowPolicyGradientOptions

    return FlowPolicyGradientOptions(noise_level=0.7, clip_range=0.2, beta=beta, adv_clip=5.0, global_std=False)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor as this process holds it (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor (a DTensor gathered: a collective, every rank calls it in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    import torch

    assert a.keys() == b.keys(), f"{what}: other keys: {sorted(set(a) ^ set(b))[:5]}"
    for key, value in a.items():
        assert torch.equal(value, b[key]), \
            f"{what}: '{key}' differs by {float((value.float() - b[key].float()).abs().max())}"


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, object]:
    out: dict[str, object] = {}
    for index, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        for key, value in optimizer.state.get(param, {}).items():
            out[f"{index}.{key}"] = _local(value).detach().cpu() if hasattr(value, "detach") else value
    return out


def check_train_engine(build_engine: Callable[[Any, TrainSection], TrainEngine],
                       build_model: Callable[[], PolicyModel] | None = None, *,
                       directory: str | Path | None = None, rank: int | None = None, height: int = 16,
                       width: int = 16, num_steps: int = 3, groups: int = 2, group_size: int = 4,
                       guidance_scale: float = 4.0, beta: float = 0.01, lr: float = 1e-2,
                       logprob_atol: float = LOGPROB_ATOL) -> dict[str, float]:
    """The train-engine contract (``omnirl_core.contracts.TrainEngine``). ``build_engine(model, train)`` returns
    the engine on ``model`` with the ``TrainSection`` ``train`` (learning rate, minibatches, micro-batches), as
    its spec's factory would with the plugin's options and device; ``build_model()`` a fresh model set up for
    training, the same base weights each call (default: the toy flow model with LoRA and a reference; a token
    model, ``omnirl_core.ar.model.CausalLMPolicy``, for the engines of AR models).

    One update with a small FlowGRPO (clipped ratio, exact KL to the reference, 2 minibatches of micro-batches
    of 2; for a token model a small GSPO over ``ar_rollout``'s samples of ``PROMPTS``, k3 KL to the reference)
    changes the trainable parameters and returns finite metrics, ``loss`` and ``grad_norm`` among them,
    with the engine's forward equal to the rollout's (``logprob/abs_delta_max`` within ``logprob_atol``);
    ``trained_state`` is CPU tensors equal to the model's, sharing no storage with the live weights;
    ``save_state`` into ``directory`` then ``load_state`` into an engine built afresh restores the weights and
    the optimizer state bit for bit, and a second update from both gives the same weights bit for bit. A sharded
    engine runs it on every rank with one shared ``directory`` (``rank``: default the process group's, or 0).
    Returns the first update's metrics."""
    import torch

    from omnirl_core.config import RunConfig
    from omnirl_core.contracts import FlowModel, TokenModel, TrainEngine
    from omnirl_core.testing import _requests, rollout

    build_model = build_model or toy_flow_model
    model = build_model()
    token = isinstance(model, TokenModel)
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    config = RunConfig()
    config.rollout.num_steps, config.rollout.height, config.rollout.width = num_steps, height, width
    train = config.train
    train.lr, train.minibatches, train.micro_batch_size = lr, 2, 2
    algorithm = _token_algorithm_class() if token else _algorithm_class()
    controller = algorithm(_options(beta), config)

    def step_units(model: PolicyModel, step: int) -> list[Sample]:
        """A rollout of ``groups`` prompts x ``group_size`` samples by ``model``, rewarded by brightness (tokens:
        by the length of the completion's text)."""
        if isinstance(model, TokenModel):
            return token_units(model, step)
        assert isinstance(model, FlowModel), f"{type(model).__name__} is neither a FlowModel nor a TokenModel"
        plan = controller.plan(step)
        scale = guidance_scale if model.guidance != "none" else 1.0
        requests = []
        for g in range(groups):
            for k in range(group_size):
                (request,) = _requests([PROMPTS[g % len(PROMPTS)]], height, width, None, plan, scale,
                                       seed=100 * step + 10 * g + k)
                request.uid, request.group = g * group_size + k, g
                requests.append(request)
        samples = rollout(model, requests)
        for s in samples:
            assert isinstance(s.output, torch.Tensor)
            s.reward = float(s.output.mean())
            s.rewards = {"brightness": s.reward}
        controller.assign_advantages(samples)
        return samples

    def token_units(model: TokenModel, step: int) -> list[Sample]:
        from omnirl_core.ar.model import CausalLMPolicy
        from omnirl_core.ar.policy_gradient import AR_PLAN
        from omnirl_core.ar.sampling import SamplingParams
        from omnirl_core.contracts import GenRequest
        from omnirl_core.testing import ar_rollout

        assert isinstance(model, CausalLMPolicy), \
            f"the token suite samples with ar_rollout, which takes a CausalLMPolicy, not a {type(model).__name__}"
        params = SamplingParams(max_new_tokens=3, stop_token_ids=model.stop_token_ids)
        requests = [GenRequest(uid=g * group_size + k, prompt=PROMPTS[g % len(PROMPTS)], prompt_index=g, group=g,
                               seed=100 * step + 10 * g + k, height=0, width=0, plan=AR_PLAN)
                    for g in range(groups) for k in range(group_size)]
        samples = ar_rollout(model, requests, params)
        for s in samples:
            s.reward = float(len(str(s.output)))
            s.rewards = {"length": s.reward}
        controller.assign_advantages(samples)
        return samples

    def units(samples: list[Sample]) -> list[TrainingUnit]:
        return controller.training_units(copy.deepcopy(samples))

    engine = build_engine(model, train)
    assert isinstance(engine, TrainEngine), f"{type(engine).__name__} is not an omnirl_core.contracts.TrainEngine"
    assert engine.model is model, "the engine's `model` must be the model it trains"
    first_samples = step_units(model, 1)
    before = engine.trained_state()
    assert before, "trained_state is empty"
    for key, value in before.items():
        assert torch.is_tensor(value) and value.device.type == "cpu" and not hasattr(value, "to_local"), \
            f"trained_state['{key}'] is not a whole CPU tensor: {type(value).__name__} on {value.device}"
    live = {_local(p).untyped_storage().data_ptr() for p in model.trainable_parameters()}
    shared = [k for k, v in before.items() if v.untyped_storage().data_ptr() in live]
    assert not shared, f"trained_state shares storage with the live weights: {shared[:3]}"
    _assert_same_state(before, {k: _dense(v).detach().cpu() for k, v in model.trained_state_dict().items()},
                       "trained_state vs the model's trained_state_dict")

    metrics = engine.update(algorithm(_options(beta), config), units(first_samples), 1)
    assert isinstance(metrics, dict) and {"loss", "grad_norm"} <= metrics.keys(), \
        f"update must return at least 'loss' and 'grad_norm': {sorted(metrics) if isinstance(metrics, dict) else metrics}"
    bad = {k: v for k, v in metrics.items() if not isinstance(v, float) or not math.isfinite(v)}
    assert not bad, f"update returned metrics that are not finite floats: {bad}"
    delta = metrics.get("logprob/abs_delta_max")
    assert delta is None or delta <= logprob_atol, \
        f"the engine's forward differs from the rollout's before any update: logprob/abs_delta_max = {delta}"
    after = engine.trained_state()
    moved = max(float((after[k].float() - before[k].float()).abs().max()) for k in before)
    assert moved > 0, "one update left every trained weight unchanged"

    temporary = None
    if directory is None:
        temporary = tempfile.TemporaryDirectory(prefix="omnirl-train-engine-")
        directory = temporary.name
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        written = engine.save_state(directory, rank)
        assert isinstance(written, list), f"save_state must return the paths it wrote, got {written!r}"
        missing = [p for p in written if not (directory / p).exists()]
        assert not missing, f"save_state names paths it did not write: {missing}"
        second_samples = step_units(model, 2)  # what the trained policy samples next

        fresh_model = build_model()
        fresh = build_engine(fresh_model, train)
        fresh.load_state(directory)
        _assert_same_state(after, fresh.trained_state(), "weights after load_state")
        saved, loaded = _optimizer_tensors(engine.optimizer), _optimizer_tensors(fresh.optimizer)
        assert saved, "the optimizer holds no state after an update"
        assert saved.keys() == loaded.keys(), f"optimizer state after load_state: {sorted(set(saved) ^ set(loaded))}"
        for key, mine in saved.items():
            theirs = loaded[key]
            if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
                same = torch.equal(mine, theirs)
            else:
                same = mine == theirs
            assert same, f"optimizer state '{key}' differs after load_state"
        for group, other in zip(engine.optimizer.param_groups, fresh.optimizer.param_groups):
            hyper = [{k: tuple(v) if isinstance(v, list) else v for k, v in g.items() if k != "params"}
                     for g in (group, other)]  # JSON brings tuples (betas) back as lists
            assert hyper[0] == hyper[1], f"optimizer hyperparameters differ after load_state: {hyper}"

        engine.update(algorithm(_options(beta), config), units(second_samples), 2)
        fresh.update(algorithm(_options(beta), config), units(second_samples), 2)
        _assert_same_state(engine.trained_state(), fresh.trained_state(),
                           "weights after a second update from the saved and the loaded engine")
    finally:
        if temporary is not None:
            temporary.cleanup()
    return metrics
