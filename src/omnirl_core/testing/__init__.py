"""Contract checks a plugin's own tests run on its tiny CPU components.

    from omnirl_core.testing import check_flow_model, check_reward

    def test_contract(tiny_model):
        check_flow_model(tiny_model, height=32, width=32)

Each check raises AssertionError with what is wrong; they assert behaviour the rest of omnirl relies on.

A flow model plugin's tests run ``check_flow_model``, ``check_batch_invariance``, ``check_logprob_consistency``
and ``check_lora_roundtrip``; an AR model's, ``check_ar_model`` and ``check_ar_logprob_consistency``. They bring
their own minimal rollout (``rollout``, ``ar_rollout``) over the core's sampler, so that a model plugin's tests
need no engine plugin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from omnirl_core.ar.model import CausalLMPolicy
    from omnirl_core.ar.sampling import SamplingParams
    from omnirl_core.config import ModelSection
    from omnirl_core.contracts import Conditioning, FlowModel, GenRequest, PolicyModel, RolloutPlan, Sample
    from omnirl_core.planning.sizing import Published
    from omnirl_core.serving.rollout_server import ServedRolloutEngine

M = TypeVar("M", bound="PolicyModel")


def check_flow_model(model: FlowModel, height: int, width: int, num_frames: int | None = None,
                     prompts: Sequence[str] = ("a red square", "a blue car on a street"),
                     images: Sequence[str] = ()) -> None:
    """The flow-model contract: shapes, fp32 velocities, a valid schedule, decoding to [0, 1], batch
    invariance of ``velocity`` (a sample's velocity does not depend on what shares its batch) and a
    reference policy. ``images``: condition images (paths of one size) for an image-conditioned model, each prompt
    encoded with one of them (``encode_with_images``), and its ``condition_key`` checked against the encoding."""
    import torch

    from omnirl_core.contracts import Conditioning

    def encode(texts: list[str]) -> Conditioning:
        return encode_prompts(model, texts, images)

    assert isinstance(model.capabilities, frozenset) and "flow-matching" in model.capabilities
    shape = tuple(model.latent_shape(height, width, num_frames))
    sigmas = model.sigmas(4, shape)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (5,), sigmas
    assert abs(float(sigmas[0]) - 1.0) < 1e-6 and float(sigmas[-1]) == 0.0, sigmas
    assert bool((sigmas[1:] < sigmas[:-1]).all()), f"sigmas must decrease: {sigmas}"

    cond = encode(list(prompts))
    assert isinstance(cond, Conditioning) and len(cond) == len(prompts)
    singles = [encode_prompts(model, [p], [images[i % len(images)]] if images else ()) for i, p in enumerate(prompts)]
    if images:
        assert model.condition_images > 0, "condition images given to a model without condition_images"
        for i, single in enumerate(singles):
            request = _requests([prompts[i]], height, width, num_frames, _plan(1), 1.0, 0, [images[i % len(images)]])[0]
            assert model.condition_key(request) == single.layout, (model.condition_key(request), single.layout)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(prompts), *shape, generator=g)
    s = torch.full((len(prompts),), 0.7)
    check_batch_invariance(model, height, width, num_frames, prompts, images)
    with torch.no_grad():
        v = model.velocity(x, s, Conditioning.cat(singles))
        assert v.dtype == torch.float32 and v.shape == x.shape, (v.dtype, v.shape)
        guidance = model.guidance
        if guidance != "none" and ("cfg" in model.capabilities or guidance == "embedded"):
            negatives = [" "] * len(prompts)  # with condition images: each with its prompt's images
            uncond = encode(negatives) if images else Conditioning.cat([model.encode([" "])] * len(prompts))
            guided = model.velocity(x, s, Conditioning.cat(singles), 4.0, uncond)
            assert guided.shape == v.shape and (guided - v).abs().max() > 0, "guidance changes nothing"
        with model.reference():
            ref = model.velocity(x, s, Conditioning.cat(singles))
        assert ref.shape == v.shape
        out = model.decode(x)
    assert out.shape[0] == len(prompts) and out.shape[1] == 3, out.shape
    assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0
    assert model.trainable_parameters(), "no trainable parameters: call setup_training first"


def _requests(prompts: Sequence[str], height: int, width: int, num_frames: int | None, plan: RolloutPlan,
              guidance_scale: float, seed: int, images: Sequence[str] = ()) -> list[GenRequest]:
    """A request per prompt; with ``images``, prompt i's record holds condition image ``images[i % len(images)]``."""
    from omnirl_core.contracts import GenRequest

    return [GenRequest(uid=i, prompt=p, prompt_index=i, group=i, seed=seed + 7 * i, height=height, width=width,
                       num_frames=num_frames, plan=plan, guidance_scale=guidance_scale,
                       inputs={"image": images[i % len(images)]} if images else {})
            for i, p in enumerate(prompts)]


def _plan(steps: int) -> RolloutPlan:
    from omnirl_core.contracts import RolloutPlan

    return RolloutPlan(step_kinds=("ode",) * steps, train_steps=())


def encode_prompts(model: FlowModel, prompts: Sequence[str], images: Sequence[str] = ()) -> Conditioning:
    """``model.encode(prompts)``, or with condition images (prompt i with ``images[i % len(images)]``)
    ``model.encode_with_images``, as the rollout engines encode a request."""
    from omnirl_core.contracts import Conditioning

    if not images:
        return model.encode(list(prompts))
    return Conditioning.cat(model.encode_with_images(list(prompts), [(images[i % len(images)],)
                                                                     for i in range(len(prompts))]))


def encode_request(model: FlowModel, request: GenRequest, prompt: str | None = None) -> Conditioning:
    """A request's one-row conditioning as the rollout engines encode it: its prompt (or ``prompt``, e.g. the
    negative one) with its condition images for a model that takes them."""
    text = request.prompt if prompt is None else prompt
    if model.condition_images > 0:
        return model.encode_with_images([text], [request.condition_images])[0]
    return model.encode([text])


def rollout(model: FlowModel, requests: Sequence[GenRequest], negative_prompt: str = " ") -> list[Sample]:
    """The minimal rollout: all ``requests`` (one latent shape, one guidance scale) denoised together by the
    core's sampler, one ``velocity`` call per step (one per condition layout: requests whose condition images
    differ in size run apart), each request drawing its initial latent and its step noise from its own seeded
    generators (as the rollout engines do). Returns ``Sample`` objects with the trajectory, the log-probs and
    ``cond`` / ``uncond`` as the trainer reads them."""
    import torch

    from omnirl_core.contracts import Sample
    from omnirl_core.flow.batching import grouped_velocity
    from omnirl_core.flow.sampler import sample_step

    first = requests[0]
    plan, scale = first.plan, first.guidance_scale
    assert all(r.plan == plan and r.guidance_scale == scale for r in requests), "one plan and scale per rollout"
    shape = tuple(model.latent_shape(first.height, first.width, first.num_frames))
    sigmas = plan.sigmas_from(model.sigmas(plan.schedule_steps, shape)).float().cpu()
    with torch.no_grad():
        conds = [encode_request(model, r) for r in requests]
        unconds = None
        if scale > 1.0:
            shared = model.encode([negative_prompt]) if model.condition_images == 0 else None
            unconds = [shared if shared is not None else encode_request(model, r, negative_prompt) for r in requests]
        x = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(
            r.noise_seed if r.noise_seed is not None else r.seed)) for r in requests])
        noise = [torch.Generator().manual_seed(r.seed + 1) for r in requests]
        states, logprobs, history = [x], torch.full((len(requests), plan.num_steps), float("nan")), None
        n = len(requests)
        for i, kind in enumerate(plan.step_kinds):
            s, s_next = sigmas[i].expand(n), sigmas[i + 1].expand(n)
            v = grouped_velocity(model, x, s, conds, scale, unconds).cpu()
            eps = None if kind in ("ode", "dpm2") else torch.stack([torch.randn(shape, generator=g) for g in noise])
            out = sample_step(kind, x, v, s, s_next, plan.eta, eps, sigmas[1].expand(n), history)
            history = (out.x0, s)
            x = out.prev_sample
            states.append(x)
            if out.logprob is not None:
                logprobs[:, i] = out.logprob
        outputs = model.decode(x)
    trajectory = torch.stack(states, dim=1)
    return [Sample(request=r, latents=trajectory[k], sigmas=sigmas.clone(), logprobs=logprobs[k], output=outputs[k],
                   cond=conds[k], uncond=unconds[k] if unconds is not None else None) for k, r in enumerate(requests)]


def screenshot(page: str | Path, shot: str | Path, width: int = 1200, height: int = 1600) -> bool:
    """Render an HTML file in headless Chromium into the PNG ``shot``, offline; False when Chromium is not installed
    (the caller skips: ``apt-get install chromium``)."""
    import shutil
    import subprocess
    from pathlib import Path

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return False
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run", f"--screenshot={shot}",
                    f"--window-size={width},{height}", Path(page).resolve().as_uri()],
                   capture_output=True, timeout=120, check=False, cwd=Path(shot).parent)
    return True


def write_sources(folder: str | Path, sizes: Sequence[tuple[int, int]]) -> tuple[str, ...]:
    """Condition images (an edit's sources) for an image-conditioned model's tests: one PNG per (width, height) in
    ``sizes`` under ``folder``, a coloured rectangle on a background of its own, so that sources of other sizes have
    other latent grids. Returns their paths."""
    from pathlib import Path

    from PIL import Image

    paths = []
    for k, (width, height) in enumerate(sizes):
        image = Image.new("RGB", (width, height), (250 - 100 * (k % 3), 40 * k % 256, 90))
        image.paste((230, 30, 30) if k % 2 else (30, 60, 230), (width // 4, height // 4, 3 * width // 4, 3 * height // 4))
        path = Path(folder) / f"source-{k}-{width}x{height}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path)
        paths.append(str(path))
    return tuple(paths)


def trainable(model: M, lora: bool = True, rank: int = 4) -> M:
    """``model`` set up as a run sets it up: a LoRA adapter of ``rank`` (or full fine-tuning) and a reference."""
    from omnirl_core.config import LoraConfig

    model.setup_training(LoraConfig(enabled=lora, rank=rank, alpha=rank), need_reference=True)
    return model


def render(pipe: Any, steps: int = 2, **kwargs: object) -> torch.Tensor:
    """One output of a diffusers pipeline for a fixed prompt and seed, as a tensor (images, or video frames)."""
    import torch

    out = pipe(prompt="a red square", num_inference_steps=steps, output_type="pt",
               generator=torch.Generator().manual_seed(0), **kwargs)
    return out.frames if hasattr(out, "frames") else out.images


def check_batch_invariance(model: FlowModel, height: int, width: int, num_frames: int | None = None,
                           prompts: Sequence[str] = ("a red square", "a blue car on a street"),
                           images: Sequence[str] = ()) -> None:
    """A sample's velocity does not depend on what shares its batch (other prompts of other lengths, other
    sigmas), to 1e-5: the rollout engines batch requests freely and the trainer re-batches transitions.
    ``images``: condition images of one size (prompt i with ``images[i % len(images)]``)."""
    import torch

    from omnirl_core.contracts import Conditioning

    shape = tuple(model.latent_shape(height, width, num_frames))
    singles = [encode_prompts(model, [p], [images[i % len(images)]] if images else ()) for i, p in enumerate(prompts)]
    x = torch.randn(len(prompts), *shape, generator=torch.Generator().manual_seed(0))
    s = torch.linspace(0.9, 0.3, len(prompts))
    with torch.no_grad():
        batch = model.velocity(x, s, Conditioning.cat(singles))
        for i, single in enumerate(singles):
            alone = model.velocity(x[i:i + 1], s[i:i + 1], single)
            err = (alone[0] - batch[i]).abs().max().item()
            assert err <= 1e-5, f"velocity of sample {i} changes with its batch by {err}"


def check_logprob_consistency(model: FlowModel, height: int, width: int, num_frames: int | None = None,
                              guidance_scale: float = 1.0, steps: int = 4, eta: float = 0.7,
                              prompts: Sequence[str] = ("a red square", "a red square", "a blue square, photo",
                                                        "a blue square, photo"),
                              images: Sequence[str] = (), tolerance: float = 1e-5) -> None:
    """Rollout and trainer compute the same numbers: with unchanged weights, the trainer's re-evaluation of
    every stored SDE transition (``omnirl_core.flow.policy_gradient.transition_stats``, in micro-batches that
    mix samples and steps unlike the rollout's batch) equals the rollout's log-prob to ``tolerance`` (the first PPO
    ratio is 1), and the log-prob is differentiable in the trainable parameters. ``images``: condition images, prompt
    i with ``images[i % len(images)]`` (images of two sizes: micro-batches mix condition layouts, which the trainer
    runs in one call each)."""
    import torch

    from omnirl_core.contracts import RolloutPlan
    from omnirl_core.flow.policy_gradient import Transition, transition_stats

    plan = RolloutPlan(step_kinds=("sde",) * (steps - 1) + ("ode",), train_steps=tuple(range(steps - 1)), eta=eta)
    samples = rollout(model, _requests(prompts, height, width, num_frames, plan, guidance_scale, 100, images))
    units = [Transition(s, j) for s in samples for j in plan.train_steps]
    units = units[::2] + units[1::2]
    stored = torch.stack([u.rollout_logprob for u in units])
    assert bool(torch.isfinite(stored).all()), stored
    with torch.no_grad():
        for start in range(0, len(units), 5):
            chunk = units[start:start + 5]
            logp = transition_stats(model, chunk, eta)[2].cpu()
            err = (logp - stored[start:start + 5]).abs().max().item()
            assert err <= tolerance, f"trainer log-prob differs from the rollout's by {err}"
    logp = transition_stats(model, units[:4], eta)[2]
    ratio = torch.exp(logp - stored[:4].to(logp.device))
    assert (ratio - 1).abs().max().item() <= max(tolerance, 1e-6), ratio
    ratio.sum().backward()
    grads = [p.grad for p in model.trainable_parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads), "no gradient reaches the trainable parameters"
    for p in model.trainable_parameters():
        p.grad = None


def check_lora_roundtrip(model: FlowModel, directory: str | Path, load_pipeline: Callable[[], Any],
                         render: Callable[[Any], torch.Tensor],
                         load_lora: Callable[[Any, Path], object] | None = None) -> None:
    """The LoRA a run saves loads into the ecosystem's own pipeline: ``model`` (set up with LoRA) gets adapter
    weights moved off their zero init (a stand-in for training), ``save_trained(directory)``; then a fresh
    ``load_pipeline()`` renders differently after ``load_lora(pipe, directory)`` (default
    ``pipe.load_lora_weights(directory)``), and every LoRA tensor the pipeline holds equals the trained one.
    ``render(pipe)`` returns an output tensor from a fixed seed."""
    from pathlib import Path

    import torch
    from peft.utils import get_peft_model_state_dict

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
    files = model.save_trained(Path(directory))
    assert files and all((Path(directory) / f).exists() for f in files), files
    pipe = load_pipeline()
    before = render(pipe)
    (load_lora or (lambda pipe, d: pipe.load_lora_weights(str(d))))(pipe, Path(directory))
    assert (render(pipe) - before).abs().max().item() > 1e-3, "the loaded LoRA does not change the output"
    trained = model.trained_state_dict()
    for name in model.trained_modules():
        component = "transformer" if name == "denoiser" else name
        module = getattr(pipe, component)
        loaded = get_peft_model_state_dict(module, adapter_name=next(iter(module.peft_config)))
        prefix = f"{component}."
        mine = ({k[len(prefix):]: v for k, v in trained.items() if k.startswith(prefix)}
                if any(k.startswith(prefix) for k in trained) else trained)
        assert mine and loaded.keys() == mine.keys(), (sorted(loaded)[:3], sorted(mine)[:3])
        for key, value in mine.items():
            torch.testing.assert_close(loaded[key], value, msg=key)


def check_model_plugin(build: Callable[..., FlowModel], height: int, width: int, num_frames: int | None = None, *,
                       guidance_scale: float = 1.0, directory: str | Path | None = None,
                       load_pipeline: Callable[[], Any] | None = None,
                       render: Callable[[Any], torch.Tensor] | None = None,
                       load_lora: Callable[[Any, Path], object] | None = None, checkpointing: object = None,
                       blocks: Callable[[FlowModel], Sequence[torch.nn.Module]] | None = None,
                       large_size: int | None = None, images: Sequence[str] = ()) -> None:
    """Every suite a flow-model plugin's tests run, in one call. ``build(gradient_checkpointing=False)`` returns a
    fresh model of the plugin's tiny preset, set up for training with LoRA (``trainable``). Always:
    ``check_flow_model`` (contract, shapes, guidance, reference, decode; batch invariance) and
    ``check_logprob_consistency`` (at ``guidance_scale``). With ``directory``, ``load_pipeline`` and ``render``:
    ``check_lora_roundtrip`` (the saved LoRA loads into the ecosystem's pipeline and changes its output). With
    ``blocks`` and ``large_size`` (the model honours ``gradient_checkpointing``): ``check_gradient_checkpointing``
    on ``build(gradient_checkpointing=False)`` and ``build(gradient_checkpointing=True)`` with the same adapter.
    ``images``: an image-conditioned model's condition images: the contract with images of one size (the first),
    the log-prob agreement with all of them (give two sizes: the trainer's micro-batches then mix layouts)."""
    check_flow_model(build(gradient_checkpointing=False), height, width, num_frames, images=images[:1])
    check_logprob_consistency(build(gradient_checkpointing=False), height, width, num_frames,
                              guidance_scale=guidance_scale, images=images)
    if directory is not None and load_pipeline is not None and render is not None:
        check_lora_roundtrip(build(gradient_checkpointing=False), directory, load_pipeline, render, load_lora)
    if blocks is not None and large_size is not None:
        import torch

        pair = [build(gradient_checkpointing=c) for c in (False, True)]
        for model in pair:  # the same non-zero adapter in both, so that every LoRA matrix gets a gradient
            generator = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in model.trainable_parameters():
                    p.copy_(0.05 * torch.randn(p.shape, generator=generator))
        check_gradient_checkpointing(pair[0], pair[1], blocks, height, large_size, num_frames)


def check_reward(reward: Callable[[Sequence[Any], Sequence[str]], Iterable[float]], outputs: Sequence[Any],
                 prompts: Sequence[str]) -> list[float]:
    """A reward returns one finite float per sample and is deterministic."""
    import math

    first = list(reward(outputs, prompts))
    assert len(first) == len(outputs), f"{len(first)} scores for {len(outputs)} samples"
    assert all(isinstance(v, float) and math.isfinite(v) for v in first), first
    assert list(reward(outputs, prompts)) == first, "the reward is not deterministic"
    return first


def check_ar_model(model: CausalLMPolicy, requests: Sequence[GenRequest]) -> None:
    """The AR contract (``omnirl_core.ar``): prompts as long token ids, fp32 log-probs <= 0 of given
    completions that do not depend on what shares the batch, a reference policy, text decoding."""
    import torch

    from omnirl_core.ar.sampling import SamplingParams, TokenPrompt

    assert isinstance(model.capabilities, frozenset) and "ar-text" in model.capabilities
    prompts = [model.encode_prompt(r) for r in requests]
    assert all(isinstance(p, TokenPrompt) and p.input_ids.dtype == torch.long and p.input_ids.dim() == 1
               for p in prompts)
    g = torch.Generator().manual_seed(0)
    vocab = min(len(model.tokenizer), 1000)
    completions = [torch.randint(0, vocab, (2 + i,), generator=g) for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.8)] * len(prompts)
    with torch.no_grad():
        batch = model.token_logprobs(prompts, completions, params)
        for i, lp in enumerate(batch):
            assert lp.dtype == torch.float32 and lp.shape == completions[i].shape, (lp.dtype, lp.shape)
            assert bool((lp <= 0).all()) and bool(torch.isfinite(lp).all()), lp
            [alone] = model.token_logprobs(prompts[i:i + 1], completions[i:i + 1], params[:1])
            err = (alone - lp).abs().max().item()
            assert err <= 1e-5, f"log-probs of row {i} change with its batch by {err}"
        with model.reference():
            ref = model.token_logprobs(prompts, completions, params)
    assert [r.shape for r in ref] == [b.shape for b in batch]
    assert isinstance(model.decode(completions[0]), str)
    assert model.trainable_parameters(), "no trainable parameters: call setup_training first"


def ar_rollout(model: CausalLMPolicy, requests: Sequence[GenRequest], params: SamplingParams) -> list[Sample]:
    """The minimal AR sampling loop (``omnirl_core.ar.sampling``): each request on its own, its tokens drawn from
    ``sampling_logprobs`` of the last position's logits with its own generator (seeded ``request.seed``, as the
    rollout engines do) until a stop token or ``params.max_new_tokens``. Returns ``Sample`` objects with the
    per-token log-probs and ``extras`` ``prompt`` / ``completion`` / ``sampling`` as the trainer reads them."""
    import torch

    from omnirl_core.ar.sampling import sample_tokens, sampling_logprobs
    from omnirl_core.contracts import Sample

    out = []
    head = model.module.get_output_embeddings()  # type: ignore[operator]  # a transformers model's method
    for request in requests:
        prompt = model.encode_prompt(request)
        generator = torch.Generator().manual_seed(request.seed)
        tokens: list[torch.Tensor] = []
        logprobs: list[torch.Tensor] = []
        with torch.no_grad():
            while len(tokens) < params.max_new_tokens:
                seq = torch.cat([prompt.input_ids, torch.stack(tokens).cpu()]) if tokens else prompt.input_ids
                hidden = model.hidden_states(model.model_inputs([seq], [prompt.media], side="left"))
                logp = sampling_logprobs(head(hidden[:, -1]), params)
                token = sample_tokens(logp, [generator])
                tokens.append(token[0].cpu())
                logprobs.append(logp[0, token[0]].float().cpu())
                if int(token[0]) in params.stop_token_ids:
                    break
        completion = torch.stack(tokens)
        out.append(Sample(request=request, latents=None, sigmas=None, logprobs=torch.stack(logprobs),
                          output=model.decode(completion),
                          prompt_tokens=prompt, completion=completion, sampling=params,
                          extras={"truncated": int(completion[-1]) not in params.stop_token_ids}))
    return out


def check_ar_logprob_consistency(model: CausalLMPolicy, requests: Sequence[GenRequest],
                                 params: SamplingParams) -> list[Sample]:
    """Rollout and trainer compute the same numbers for an AR model: completions sampled by ``ar_rollout`` are
    re-scored by ``model.token_logprobs`` in micro-batches that mix the requests unlike the rollout (as the
    trainer does) and every token's log-prob equals the sampled one to 1e-5; returns the samples."""
    import torch

    from omnirl_core.ar.sampling import completion_tokens

    samples = ar_rollout(model, requests, params)
    assert all(s.logprobs is not None and s.prompt_tokens is not None and len(s.logprobs) >= 1
               and bool(torch.isfinite(s.logprobs).all()) for s in samples)
    order = list(range(0, len(samples), 2)) + list(range(1, len(samples), 2))
    with torch.no_grad():
        for start in range(0, len(order), 3):
            chunk = [samples[i] for i in order[start:start + 3]]
            rescored = model.token_logprobs([s.prompt_tokens for s in chunk if s.prompt_tokens is not None],
                                            [completion_tokens(s) for s in chunk], [params] * len(chunk))
            for s, lp in zip(chunk, rescored):
                assert s.logprobs is not None
                err = (lp.float().cpu() - s.logprobs).abs().max().item()
                assert err < 1e-5, f"trainer log-probs differ from the sampled ones by {err}"
    return samples


_REFUSE_NETWORK = """
import socket
_calls = []
def _refuse(*args, **kwargs):
    _calls.append(repr(args))
    raise OSError("network access refused by the test")
socket.getaddrinfo = socket.create_connection = socket.socket.connect = _refuse
"""


def offline_error(setup: str, call: str) -> str:
    """What a user sees when a checkpoint cannot be fetched: runs ``setup`` (imports) then ``call`` in a fresh
    process with the hub offline (``HF_HUB_OFFLINE=1`` in the environment, as users set it) and every socket
    refused and recorded; asserts that it raises omnirl's ``UsageError`` without one network call and returns
    its rendered text."""
    import os
    import subprocess
    import sys

    code = (f"{_REFUSE_NETWORK}{setup}\nfrom omnirl_core.errors import UsageError\ntry:\n    {call}\n"
            "except UsageError as e:\n    print('ERR', e.render())\nprint('NETWORK CALLS:', _calls)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.stdout.startswith("ERR "), out.stderr[-2000:]
    text, _, calls = out.stdout[4:].rpartition("NETWORK CALLS:")
    assert calls.strip() == "[]", f"network calls while offline: {calls.strip()}"
    return text


def check_unreachable_hub_id(loader: str, hub_id: str, name: str) -> str:
    """A model plugin's ``loader`` (``"module:function"`` taking a path or hub id and a dtype) given a hub id
    while the hub is unreachable: ``offline_error``'s checks, and the message says it could not load ``name``
    from ``hub_id`` and names the tiny preset. Returns the message."""
    module, _, function = loader.partition(":")
    text = offline_error(f"import torch\nfrom {module} import {function}", f"{function}({hub_id!r}, torch.float32)")
    assert f"Could not load {name} from {hub_id!r}" in text and "--preset tiny" in text, text
    return text


def check_import_is_cheap(module: str) -> None:
    """Importing ``module`` (a plugin's entry module) in a fresh process imports no torch: discovery stays cheap."""
    import subprocess
    import sys

    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", f"importing {module} imports torch"


def installed_algorithms() -> set[str]:
    """The names ``omnirl list algos`` shows: an end-to-end test skips an algorithm plugin not installed."""
    import json

    from omnirl_core.testing.forkserver import run_omnirl

    out = run_omnirl(["list", "algos", "--format", "json"])
    assert out.returncode == 0, out.stderr[-3000:]
    return {a["name"] for a in json.loads(out.stdout)}


def run_train(run_dir: str | Path, *args: str, timeout: int = 600) -> list[dict[str, Any]]:
    """Drive the real ``omnirl train`` console script into ``run_dir`` (an end-to-end test); asserts it exits
    0 and returns the run's metrics records."""
    import json
    from pathlib import Path

    from omnirl_core.testing.forkserver import run_omnirl

    result = run_omnirl(["train", "-o", str(run_dir), *args], timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


TIMED_METRICS = ("time/", "images_per_s", "threads/")
"""Metric name prefixes measured on the machine (its load), not computed by the run: left out when runs are compared."""


def check_killed_run_resumes(whole: str | Path, killed: str | Path, args: Sequence[str], steps: int, weights: str,
                             kill_after: int = 2, timeout: int = 900) -> list[dict[str, Any]]:
    """A run killed in the middle of a step resumes bit for bit, through the real CLI: ``omnirl train -o whole *args
    --steps steps``; the same into ``killed``, its driver SIGKILLed the moment checkpoint ``kill_after`` is complete
    (so inside step ``kill_after + 1``; asserted: ``kill_after`` rows at the kill; ``args`` must save a checkpoint at
    that step), then the same command again. The metrics rows (timings aside) and the last checkpoint's ``weights`` file
    must equal the uninterrupted run's bit for bit. Returns the uninterrupted run's rows."""
    import json
    import signal
    import subprocess
    import time
    from pathlib import Path

    from safetensors.torch import load_file

    from omnirl_core.testing.forkserver import omnirl_script

    def rows(run: Path) -> list[dict[str, Any]]:
        path = run / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def untimed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if not k.startswith(TIMED_METRICS)} for r in records]

    def train(run: Path) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(omnirl_script()), "train", "-o", str(run), *args, "--steps", str(steps)],
                              capture_output=True, text=True, timeout=timeout, check=False)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        return proc

    whole, killed = Path(whole), Path(killed)
    train(whole)
    done = rows(whole)
    assert [r["step"] for r in done] == list(range(1, steps + 1))
    proc = subprocess.Popen([str(omnirl_script()), "train", "-o", str(killed), *args, "--steps", str(steps)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    latest, mark = killed / "checkpoints" / "latest", f"step-{kill_after:06d}"
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:  # the next step begins as the checkpoint completes
        if latest.is_file() and latest.read_text().strip() == mark:
            break
        time.sleep(0.005)
    assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert [r["step"] for r in rows(killed)] == list(range(1, kill_after + 1)), "the kill did not land in the step"
    assert "resuming" in train(killed).stderr
    assert untimed(rows(killed)) == untimed(done)
    last = f"step-{steps:06d}"
    a, b = (load_file(str(run / "checkpoints" / last / weights)) for run in (whole, killed))
    assert a and a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    return done


def reward_rise(run_dir: str | Path, key: str = "reward/mean", window: int = 10) -> tuple[float, float, float]:
    """(mean of the first ``window`` steps, mean of the last ``window``, standard error of their difference)
    of a metric in a run directory's metrics.jsonl."""
    import json
    import statistics
    from pathlib import Path

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    values = [json.loads(line)[key] for line in lines]
    first, last = values[:window], values[-window:]
    se = (statistics.variance(first) / window + statistics.variance(last) / window) ** 0.5
    return statistics.fmean(first), statistics.fmean(last), se


def check_reward_rises(run_dir: str | Path, reward: str, steps: int, *args: str, model: str,
                       algo: str) -> tuple[float, float, float]:
    """A reward plugin's end-to-end check: ``omnirl train --model model --algo algo`` on the model's tiny preset
    with ``--reward reward``
    (``args``: more flags, e.g. ``--set rewards.0.options.preset=tiny``) for ``steps`` steps, through the real
    CLI; the mean reward of the last 10 steps must exceed the first 10's by at least 2 standard errors."""
    from omnirl_core.testing.forkserver import run_omnirl

    proc = run_omnirl(["train", "--model", model, "--algo", algo, "--preset", "tiny", "--reward", reward,
                       "--steps", str(steps), "--output-dir", str(run_dir), *args], timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last, se = reward_rise(run_dir)
    print(f"{reward}: first 10 {first:.4f}, last 10 {last:.4f}, SE {se:.4f}, {(last - first) / se:.1f} SE")
    assert last - first >= 2 * se, (first, last, se)
    return first, last, se


def check_reward_in_a_run(run_dir: str | Path, reward: str, *args: str, model: str, algo: str,
                          steps: int = 2) -> list[dict[str, Any]]:
    """A reward plugin's end-to-end wiring: ``omnirl train`` on the model's tiny preset with ``--reward reward``
    for ``steps`` steps through the real CLI. Every step has its row with a finite ``reward/<reward>``, and the
    scores differ between the samples of a step. (That training raises the reward is ``check_reward_rises``, a
    run of minutes: a ``long`` test.)"""
    import math

    rows = run_train(run_dir, "--model", model, "--algo", algo, "--preset", "tiny", "--reward", reward,
                     "--steps", str(steps), *args)
    assert [row["step"] for row in rows] == list(range(1, steps + 1)), rows
    key = f"reward/{reward}"
    assert all(key in row and math.isfinite(row[key]) for row in rows), [row.get(key) for row in rows]
    assert any(row["reward/std"] > 0 for row in rows), "every sample got the same score"
    return rows


def sde_loss(model: FlowModel, height: int, width: int, num_frames: int | None = None,
             guidance_scale: float | None = None) -> torch.Tensor:
    """The Flow-SDE log-prob of a fixed pair of transitions under ``model`` (what every policy-gradient loss is
    made of), as a scalar loss with grad: for gradient-checkpointing and memory checks. With ``guidance_scale``,
    the velocity is guided against the prompt " " (CFG on)."""
    import torch

    from omnirl_core.flow.sampler import step_mean, transition_logprob

    generator = torch.Generator().manual_seed(1)
    shape = (2, *model.latent_shape(height, width, num_frames))
    x, x_next = (torch.randn(shape, generator=generator).to(model.device) for _ in range(2))
    s, s_next = torch.tensor([0.9, 0.5], device=model.device), torch.tensor([0.8, 0.4], device=model.device)
    cond = model.encode(["a red square", "a blue car, photo"])
    if guidance_scale is None:
        v = model.velocity(x, s, cond)
    else:
        v = model.velocity(x, s, cond, guidance_scale, model.encode([" ", " "]))
    mean, std = step_mean("sde", x, v, s, s_next, 0.7)
    return -transition_logprob("sde", x_next, mean, std).mean()


def checkpointing_pair(create_model: Callable[[ModelSection, Any, str], FlowModel], section: ModelSection,
                       options: Callable[[bool], Any], device: str = "cpu") -> dict[bool, FlowModel]:
    """A model plugin's model built twice from ``section``, without and with gradient checkpointing
    (``options(checkpointing)`` gives its options), each with the same non-zero adapter (``with_same_adapter``):
    the pair ``check_checkpointed_gradients`` and ``check_checkpointing_keeps_fewer_activations`` compare, by
    ``checkpointing``."""
    return {c: with_same_adapter(create_model(section, options(c), device)) for c in (False, True)}


def with_same_adapter(model: M, seed: int = 0) -> M:
    """``model`` set up to train a rank-4 LoRA (no reference), the adapter filled with the same non-zero weights
    (0.05 N(0, 1) from ``seed``) as every model built alike: two such models, with and without gradient
    checkpointing, then give every LoRA matrix a gradient to compare."""
    import torch

    from omnirl_core.config import LoraConfig

    model.setup_training(LoraConfig(enabled=True, rank=4, alpha=4), need_reference=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return model


def check_checkpointing_flags(model: PolicyModel, on: bool) -> None:
    """Every trained module of ``model`` has gradient checkpointing ``on`` (its ``gradient_checkpointing``)."""
    flags = {name: getattr(m, "gradient_checkpointing", None) for name, m in model.trained_modules().items()}
    assert all(flag == on for flag in flags.values()), f"gradient_checkpointing {flags}, expected {on}"


def check_checkpointed_gradients(plain: FlowModel, checkpointed: FlowModel, size: int, num_frames: int | None = None,
                                 guidance_scale: float | None = None, min_nonzero: float = 0.75) -> None:
    """Two models alike but for gradient checkpointing (``with_same_adapter``), which is off in every trained
    module of ``plain`` and on in ``checkpointed``'s: the same ``sde_loss`` at ``size`` and the same gradients
    (1e-5), the same parameters with none; at least ``min_nonzero`` of the trainable parameters get a non-zero
    gradient (1.0: every one)."""
    import torch

    check_checkpointing_flags(plain, False)
    check_checkpointing_flags(checkpointed, True)
    results = []
    for model in (plain, checkpointed):
        for p in model.trainable_parameters():
            p.grad = None
        loss = sde_loss(model, size, size, num_frames, guidance_scale)
        loss.backward()
        results.append((loss.detach(), [None if p.grad is None else p.grad.clone()
                                        for p in model.trainable_parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-5)
    nonzero = sum(g is not None and bool(g.abs().sum() > 0) for g in grads_a)
    assert nonzero >= min_nonzero * len(grads_a), f"{nonzero} of {len(grads_a)} gradients are non-zero"
    for k, (a, b) in enumerate(zip(grads_a, grads_b)):
        assert (a is None) == (b is None), f"trainable parameter {k}: a gradient in one model only"
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"trainable parameter {k}")


def check_checkpointing_keeps_fewer_activations(plain: FlowModel, checkpointed: FlowModel,
                                                blocks: Callable[[FlowModel], Sequence[torch.nn.Module]], size: int,
                                                num_frames: int | None = None,
                                                guidance_scale: float | None = None) -> None:
    """The checkpointed model keeps fewer than half the bytes for the backward pass of ``sde_loss`` at ``size``
    (``kept_for_backward_bytes`` over ``blocks(model)``, the checkpointed blocks)."""
    check_checkpointing_flags(plain, False)
    check_checkpointing_flags(checkpointed, True)
    kept = [kept_for_backward_bytes(  # mypy cannot type the lambda's default argument
        list(m.trained_modules().values()), blocks(m),
        lambda m=m: sde_loss(m, size, size, num_frames, guidance_scale).backward())  # type: ignore[misc, unused-ignore]
        for m in (plain, checkpointed)]
    assert kept[1] < 0.5 * kept[0], kept


def check_gradient_checkpointing(plain: FlowModel, checkpointed: FlowModel,
                                 blocks: Callable[[FlowModel], Sequence[torch.nn.Module]], size: int, large_size: int,
                                 num_frames: int | None = None) -> None:
    """Two models alike but for gradient checkpointing (set up for training, the same non-zero adapter): the
    same loss and gradients (1e-5), and at ``large_size`` fewer than half the bytes kept for the backward pass
    (``kept_for_backward_bytes`` over ``blocks(model)``, the checkpointed blocks)."""
    check_checkpointed_gradients(plain, checkpointed, size, num_frames)
    check_checkpointing_keeps_fewer_activations(plain, checkpointed, blocks, large_size, num_frames)


def check_checkpointing_lowers_peak_gpu_memory(build: Callable[[bool], FlowModel], size: int,
                                               num_frames: int | None = None) -> None:
    """``build(checkpointing)`` on a CUDA device, without and with gradient checkpointing: the backward pass of
    ``sde_loss`` at ``size`` peaks lower with it (``torch.cuda.max_memory_allocated``)."""
    import torch

    peaks = {}
    for checkpointing in (False, True):
        model = build(checkpointing)
        check_checkpointing_flags(model, checkpointing)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        sde_loss(model, size, size, num_frames).backward()
        torch.cuda.synchronize()
        peaks[checkpointing] = torch.cuda.max_memory_allocated() - base
        del model
        torch.cuda.empty_cache()
    assert peaks[True] < peaks[False], peaks


def matches_published(count: int, published: Published) -> bool:
    """A parameter count against a published figure (``omnirl_core.planning.sizing.Published``): within 1 %, or within
    the figure's own rounding when that is coarser (a truncated figure: the count lies in [value, value +
    resolution))."""
    if published.truncated:
        return published.value <= count < published.value + published.resolution
    return abs(count - published.value) <= max(0.01 * published.value, published.resolution / 2)


def check_matches_published(count: int, published: Published, what: str) -> None:
    """``matches_published``, or an AssertionError naming ``what``, both figures and the figure's source."""
    assert matches_published(count, published), (
        f"{what}: {count:,} vs published {published.value:,.0f} ({published.source})")


def check_lora_numel(module: torch.nn.Module, targets: tuple[str, ...] | str, rank: int = 8) -> int:
    """``omnirl_core.planning.sizing.lora_numel`` against what peft adds to ``module`` (``inject_adapter_in_model``,
    which diffusers' ``add_adapter`` calls) for the same ``targets`` and ``rank``: equal and non-zero. Returns
    the count. A full-width module of two or three blocks on meta keeps it quick."""
    from peft import LoraConfig, inject_adapter_in_model

    from omnirl_core.planning.sizing import lora_numel

    expected = lora_numel(module, targets, rank)
    target_modules = targets if isinstance(targets, str) else list(targets)
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=target_modules), module)
    added = sum(p.numel() for name, p in module.named_parameters() if "lora_" in name)
    assert expected == added > 0, f"lora_numel counts {expected:,}, peft added {added:,}"
    return expected


def build_on_meta(build: Callable[..., dict[str, torch.nn.Module]], variants: Sequence[str] | None = None) -> Any:
    """(``build()``'s modules, the seconds it took, MiB the process grew by) for a full-size build on the meta
    device, diffusers and transformers imported first (imports are not what is measured); with ``variants``, a
    dict of them, one per ``build(variant)``."""
    import importlib
    import importlib.util
    import resource
    import time

    for library in ("diffusers", "transformers"):
        if importlib.util.find_spec(library) is not None:
            importlib.import_module(library)
    if variants is not None:
        return {v: build_on_meta(lambda v=v: build(v)) for v in variants}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    components = build()
    seconds = time.perf_counter() - start
    return components, seconds, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024


def check_on_meta(components: dict[str, torch.nn.Module], seconds: float, grown_mib: float, max_seconds: float = 30,
                  max_mib: float = 512) -> None:
    """Every tensor of every module is on ``meta`` (no storage), the build took seconds and grew the process by
    bookkeeping only (a full-size model in fp32 would be tens of GB)."""
    for name, module in components.items():
        tensors = list(module.parameters()) + list(module.buffers())
        assert tensors and all(t.is_meta for t in tensors), name
    assert seconds < max_seconds, f"building took {seconds:.1f} s"
    assert grown_mib < max_mib, f"the process grew by {grown_mib:.0f} MiB"


def kept_for_backward_bytes(modules: Sequence[torch.nn.Module], blocks: Sequence[torch.nn.Module],
                            run: Callable[[], object]) -> int:
    """Bytes ``run()``'s forward pass keeps alive for the backward pass, parameters of ``modules`` excluded,
    each storage once: the tensors autograd saves outside checkpointed regions plus the inputs of every one of
    ``blocks`` (a gradient checkpoint keeps them to recompute the block). CPU torch has no allocator
    statistics; this is what gradient checkpointing changes, measured directly."""
    import torch

    params = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
    kept: dict[int, torch.Tensor] = {}

    def keep(t: object) -> None:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    def pre_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for value in (*args, *kwargs.values()):
            keep(value)

    handles = [b.register_forward_pre_hook(pre_hook, with_kwargs=True) for b in blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for handle in handles:
            handle.remove()
    return sum(t.untyped_storage().nbytes() for t in kept.values())


def perturb_trainable(model: PolicyModel, seed: int, scale: float) -> None:
    """An update as an optimizer step makes it: in place (torch's version counters move), every trainable
    tensor (a LoRA's B included, which starts at zero)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def check_weight_update_reaches_engine(model: PolicyModel, make_engine: Callable[..., ServedRolloutEngine],
                                       requests: list[GenRequest],
                                       delta: Callable[[PolicyModel, list[Sample]], float], sync: str,
                                       seed: int, scale: float, tolerance: float = 1e-5) -> None:
    """For a rollout engine with weight sync: after an update, the next rollout's log-probs agree with the
    trainer's (``delta(model, samples)``) only if the weights were synced (``make_engine(weight_sync=...)``).
    The model's trained weights, and the engine's, are put back afterwards."""
    import torch

    saved = [p.detach().clone() for p in model.trainable_parameters()]
    try:
        stale = make_engine(weight_sync="none")
        fresh = make_engine(weight_sync=sync)
        perturb_trainable(model, seed, scale)
        without = delta(model, list(stale.generate(requests)))
        with_sync = delta(model, list(fresh.generate(requests)))
        print(f"weight_sync={sync}: |delta| without sync {without:.3g}, with sync {with_sync:.3g} "
              f"({fresh.syncs} sync, {fresh.sync_seconds:.2f} s)")
        assert fresh.syncs == 1
        assert with_sync <= tolerance, with_sync
        assert without > 100 * tolerance, without
    finally:
        with torch.no_grad():
            for p, s in zip(model.trainable_parameters(), saved):
                p.copy_(s)
        make_engine(weight_sync=sync).sync_weights(force=True)


def require_engine_environment(name: str, device: str = "cpu") -> None:
    """Skip the calling test unless the engine plugin is installed and its environment built."""
    import pytest

    from omnirl_core.errors import UsageError
    from omnirl_core.serving.envs import component_environment, is_built

    try:
        built = is_built(component_environment(name, device))
    except UsageError as exc:  # the plugin itself is not installed in this environment
        pytest.skip(f"the {name} engine plugin is not installed: {exc.message}")
    if not built:
        pytest.skip(f"the {name} environment is not built (omnirl env build {name} --device {device})")
