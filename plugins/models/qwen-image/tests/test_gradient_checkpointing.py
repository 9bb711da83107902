"""Gradient checkpointing on the tiny preset: the same loss and gradients with and without it, and fewer
activations kept for the backward pass at a larger resolution.

Memory on CPU: torch has no CPU allocator statistics, so the test measures what checkpointing changes, the
tensors the forward pass keeps alive for the backward pass (those autograd saves outside checkpointed regions,
plus every block's inputs, which a checkpoint keeps to recompute the block), parameters excluded, each storage
once. On a GPU the ``gpu`` test compares ``torch.cuda.max_memory_allocated``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omnirl_plugin_qwen_image.model import QwenImageOptions, create_model
from omnirl_plugin_qwen_image.tiny import save_tiny

from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.flow.sampler import step_mean, transition_logprob
from omnirl_core.testing import kept_for_backward_bytes


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("qwen-image-tiny"), seed=3)


def _model(tiny_dir: Path, checkpointing: bool, device: str = "cpu"):
    options = QwenImageOptions(gradient_checkpointing=checkpointing)
    model = create_model(ModelSection(name="qwen-image", preset="tiny", path=str(tiny_dir)), options, device)
    model.setup_training(LoraConfig(enabled=True, rank=4, alpha=4), need_reference=False)
    assert model.denoiser.gradient_checkpointing == checkpointing
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the same non-zero adapter in both models, so that every LoRA matrix gets a gradient
        for p in model.trainable_parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def models(tiny_dir: Path) -> dict:
    return {checkpointing: _model(tiny_dir, checkpointing) for checkpointing in (False, True)}


def _loss(model, size: int) -> torch.Tensor:
    """The Flow-SDE log-prob of a fixed transition under the model: what every policy-gradient loss is made of."""
    generator = torch.Generator().manual_seed(1)
    shape = (2, *model.latent_shape(size, size))
    x, x_next = (torch.randn(shape, generator=generator).to(model.device) for _ in range(2))
    s, s_next = torch.tensor([0.9, 0.5], device=model.device), torch.tensor([0.8, 0.4], device=model.device)
    v = model.velocity(x, s, model.encode(["a red square", "a blue car, photo"]))
    mean, std = step_mean("sde", x, v, s, s_next, 0.7)
    return -transition_logprob("sde", x_next, mean, std).mean()


def _kept_bytes(model, run) -> int:
    """Bytes the forward pass keeps for the backward pass (see the module docstring)."""
    return kept_for_backward_bytes([model.denoiser], model.denoiser.transformer_blocks, run)


def test_checkpointing_gives_the_same_loss_and_gradients(models):
    results = []
    for checkpointing in (False, True):
        model = models[checkpointing]
        model.denoiser.zero_grad(set_to_none=True)
        loss = _loss(model, 32)
        loss.backward()
        # the last block's prompt-stream output is never read: its text-query, output and text-MLP adapters get
        # no gradient (or a zero one), in both runs alike
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.denoiser.named_parameters()
                                        if p.requires_grad and p.grad is not None}))
        trainable = len(model.trainable_parameters())
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-5)
    assert grads_a.keys() == grads_b.keys()
    assert sum(bool(g.abs().sum() > 0) for g in grads_a.values()) >= 0.75 * trainable
    for name, a in grads_a.items():
        torch.testing.assert_close(grads_b[name], a, rtol=1e-5, atol=1e-5, msg=name)


def test_checkpointing_keeps_far_fewer_activations_for_the_backward_pass(models):
    kept = {}
    for checkpointing, model in models.items():
        kept[checkpointing] = _kept_bytes(model, lambda m=model: _loss(m, 128).backward())
    assert kept[True] < 0.5 * kept[False], kept


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_checkpointing_lowers_peak_gpu_memory(tiny_dir: Path):
    peaks = {}
    for checkpointing in (False, True):
        model = _model(tiny_dir, checkpointing, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _loss(model, 256).backward()
        torch.cuda.synchronize()
        peaks[checkpointing] = torch.cuda.max_memory_allocated() - base
        del model
        torch.cuda.empty_cache()
    assert peaks[True] < peaks[False], peaks
