"""Contract checks a plugin's own tests run on its tiny CPU components.

    from omnirl_core.testing import check_flow_model, check_reward

    def test_contract(tiny_model):
        check_flow_model(tiny_model, height=32, width=32)

Each check raises AssertionError with what is wrong; they assert behaviour the rest of omnirl relies on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def check_flow_model(model: Any, height: int, width: int, num_frames: int | None = None,
                     prompts: Sequence[str] = ("a red square", "a blue car on a street")) -> None:
    """The flow-model contract: shapes, fp32 velocities, a valid schedule, decoding to [0, 1], batch
    invariance of ``velocity`` (a sample's velocity does not depend on what shares its batch) and a
    reference policy."""
    import torch

    from omnirl_core.interfaces import Conditioning

    assert isinstance(model.capabilities, frozenset) and "flow-matching" in model.capabilities
    shape = tuple(model.latent_shape(height, width, num_frames))
    sigmas = model.sigmas(4, shape)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (5,), sigmas
    assert abs(float(sigmas[0]) - 1.0) < 1e-6 and float(sigmas[-1]) == 0.0, sigmas
    assert bool((sigmas[1:] < sigmas[:-1]).all()), f"sigmas must decrease: {sigmas}"

    cond = model.encode(list(prompts))
    assert isinstance(cond, Conditioning) and len(cond) == len(prompts)
    singles = [model.encode([p]) for p in prompts]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(prompts), *shape, generator=g)
    s = torch.full((len(prompts),), 0.7)
    with torch.no_grad():
        v = model.velocity(x, s, Conditioning.cat(singles))
        assert v.dtype == torch.float32 and v.shape == x.shape, (v.dtype, v.shape)
        for i, single in enumerate(singles):
            alone = model.velocity(x[i:i + 1], s[i:i + 1], single)
            err = (alone[0] - v[i]).abs().max().item()
            assert err <= 1e-5, f"velocity of sample {i} changes with its batch by {err}"
        if "cfg" in model.capabilities:
            uncond = Conditioning.cat([model.encode([" "])] * len(prompts))
            guided = model.velocity(x, s, Conditioning.cat(singles), 4.0, uncond)
            assert guided.shape == v.shape and (guided - v).abs().max() > 0
        with model.reference():
            ref = model.velocity(x, s, Conditioning.cat(singles))
        assert ref.shape == v.shape
        out = model.decode(x)
    assert out.shape[0] == len(prompts) and out.shape[1] == 3, out.shape
    assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0
    assert model.trainable_parameters(), "no trainable parameters: call setup_training first"


def check_reward(reward: Any, outputs: Sequence[Any], prompts: Sequence[str]) -> list[float]:
    """A reward returns one finite float per sample and is deterministic."""
    import math

    first = list(reward(outputs, prompts))
    assert len(first) == len(outputs), f"{len(first)} scores for {len(outputs)} samples"
    assert all(isinstance(v, float) and math.isfinite(v) for v in first), first
    assert list(reward(outputs, prompts)) == first, "the reward is not deterministic"
    return first


def check_ar_model(model: Any, requests: Sequence[Any]) -> None:
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


def run_train(run_dir: Any, *args: str, timeout: int = 600) -> list[dict[str, Any]]:
    """Drive the real ``omnirl train`` console script into ``run_dir`` (an end-to-end test); asserts it exits
    0 and returns the run's metrics records."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("omnirl")
    result = subprocess.run([str(exe), "train", "-o", str(run_dir), *args], capture_output=True, text=True,
                            timeout=timeout, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def reward_rise(run_dir: Any, key: str = "reward/mean", window: int = 10) -> tuple[float, float, float]:
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


def check_reward_rises(run_dir: Any, reward: str, steps: int, *args: str, model: str = "qwen-image",
                       algo: str = "flowgrpo") -> tuple[float, float, float]:
    """A reward plugin's end-to-end check: ``omnirl train`` on the model's tiny preset with ``--reward reward``
    (``args``: more flags, e.g. ``--set rewards.0.options.preset=tiny``) for ``steps`` steps, through the real
    CLI; the mean reward of the last 10 steps must exceed the first 10's by at least 2 standard errors."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("omnirl")
    proc = subprocess.run([str(exe), "train", "--model", model, "--algo", algo, "--preset", "tiny",
                           "--reward", reward, "--steps", str(steps), "--output-dir", str(run_dir), *args],
                          capture_output=True, text=True, env=dict(os.environ), timeout=3600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last, se = reward_rise(run_dir)
    print(f"{reward}: first 10 {first:.4f}, last 10 {last:.4f}, SE {se:.4f}, {(last - first) / se:.1f} SE")
    assert last - first >= 2 * se, (first, last, se)
    return first, last, se


def kept_for_backward_bytes(modules: Sequence[Any], blocks: Sequence[Any], run: Any) -> int:
    """Bytes ``run()``'s forward pass keeps alive for the backward pass, parameters of ``modules`` excluded,
    each storage once: the tensors autograd saves outside checkpointed regions plus the inputs of every one of
    ``blocks`` (a gradient checkpoint keeps them to recompute the block). CPU torch has no allocator
    statistics; this is what gradient checkpointing changes, measured directly."""
    import torch

    params = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
    kept: dict[int, Any] = {}

    def keep(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t

    def pre_hook(module: Any, args: Any, kwargs: Any) -> None:
        for value in (*args, *kwargs.values()):
            keep(value)

    handles = [b.register_forward_pre_hook(pre_hook, with_kwargs=True) for b in blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: keep(t) or t, lambda t: t):
            run()
    finally:
        for handle in handles:
            handle.remove()
    return sum(t.untyped_storage().nbytes() for t in kept.values())
