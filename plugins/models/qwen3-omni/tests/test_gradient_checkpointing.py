"""Gradient checkpointing on the tiny preset: the same token log-probs, loss and gradients with and without it
(text, image and audio prompts), rollout unaffected, and fewer activations kept by the decoder on long prompts.

Memory on CPU: torch has no CPU allocator statistics, so the test measures what checkpointing changes, the
tensors the decoder's forward pass keeps alive for the backward pass (those autograd saves outside checkpointed
regions, plus every decoder layer's inputs, which a checkpoint keeps to recompute the layer), parameters
excluded, each storage once. The LM head's logits are outside the decoder layers and not checkpointed."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from omnirl_plugin_qwen3_omni.model import Qwen3OmniOptions, create_model
from omnirl_plugin_qwen3_omni.tiny import save_tiny
from PIL import Image

from omnirl_core.ar.policy_gradient import AR_PLAN
from omnirl_core.ar.sampling import SamplingParams
from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.contracts import GenRequest
from omnirl_core.testing import ar_rollout, kept_for_backward_bytes


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (48, 80, 3), dtype=np.uint8)).save(root / "noise.png")
    with wave.open(str(root / "tone.wav"), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(16000)
        wav.writeframes((np.sin(2 * np.pi * 440 * np.arange(8000) / 16000) * 12000).astype(np.int16).tobytes())
    return {"image": str(root / "noise.png"), "audio": str(root / "tone.wav")}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    path = save_tiny(tmp_path_factory.mktemp("qwen3-omni-tiny"), seed=3)
    return {checkpointing: _model(path, checkpointing) for checkpointing in (False, True)}


def _model(path: Path, checkpointing: bool):
    options = Qwen3OmniOptions(gradient_checkpointing=checkpointing)
    model = create_model(ModelSection(name="qwen3-omni", preset="tiny", path=str(path)), options, "cpu")
    model.setup_training(LoraConfig(rank=4, alpha=8), need_reference=False)
    layers = model.module.model.language_model.layers
    assert all(layer.gradient_checkpointing == checkpointing for layer in layers)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the same non-zero adapter in both models, so that every LoRA matrix gets a gradient
        for p in model.trainable_parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return model


def _batch(model, media: dict[str, str], question: str = "Which letter? A or B."):
    requests = [GenRequest(uid=i, prompt=question, prompt_index=i, group=i, seed=i, height=0, width=0, plan=AR_PLAN,
                           inputs=inputs)
                for i, inputs in enumerate([{}, {"image": media["image"]}, {"audio": media["audio"]}])]
    prompts = [model.encode_prompt(r) for r in requests]
    completions = [torch.tensor([model.token_id(t) for t in letters]) for letters in ("AB", "BAC", "C")]
    return prompts, completions, [SamplingParams()] * len(prompts)


def _kept_bytes(model, run) -> int:
    """Bytes the decoder's forward pass keeps for the backward pass (see the module docstring)."""
    return kept_for_backward_bytes([model.module], model.module.model.language_model.layers, run)


def test_checkpointing_gives_the_same_logprobs_loss_and_gradients(models, media: dict[str, str]):
    results = []
    for checkpointing in (False, True):
        model = models[checkpointing]
        model.module.zero_grad(set_to_none=True)
        logprobs = model.token_logprobs(*_batch(model, media))
        loss = -torch.cat(logprobs).mean()
        loss.backward()
        results.append((torch.cat(logprobs).detach(), loss.detach(),
                        [p.grad.clone() for p in model.trainable_parameters()]))
    (lp_a, loss_a, grads_a), (lp_b, loss_b, grads_b) = results
    torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-5)
    assert len(grads_a) == len(grads_b) > 0 and all(g.abs().sum() > 0 for g in grads_a)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_rollout_is_unchanged_by_checkpointing(models):
    """Generation runs without grad: the same tokens and log-probs with the decoder layers in training mode."""
    requests = [GenRequest(uid=i, prompt="Which letter? A or B.", prompt_index=0, group=0, seed=10 + i, height=0,
                           width=0, plan=AR_PLAN) for i in range(3)]
    runs = [ar_rollout(models[c], requests, SamplingParams(max_new_tokens=4, stop_token_ids=models[c].stop_token_ids))
            for c in (False, True)]
    for a, b in zip(*runs):
        assert torch.equal(a.completion, b.completion)
        torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=1e-6)


def test_checkpointing_keeps_far_fewer_decoder_activations_on_long_prompts(models):
    kept = {}
    for checkpointing, model in models.items():
        ids = torch.tensor(model.tokenizer("a long prompt about letters " * 60)["input_ids"])
        inputs = model.model_inputs([ids, ids.flip(0)], [{}, {}], side="right")
        kept[checkpointing] = _kept_bytes(model, lambda m=model, i=inputs: m.hidden_states(i).pow(2).mean().backward())
    assert kept[True] < 0.5 * kept[False], kept


def test_a_checkpoint_with_attention_dropout_is_refused(models):
    from omnirl_core.errors import UsageError

    model = models[True]
    config = model.module.config.text_config
    saved, config.attention_dropout = config.attention_dropout, 0.1
    try:
        with pytest.raises(UsageError, match="attention dropout"):
            model._enable_gradient_checkpointing()
    finally:
        config.attention_dropout = saved
