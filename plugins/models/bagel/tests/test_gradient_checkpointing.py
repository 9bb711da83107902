"""Gradient checkpointing on the tiny preset: the same loss and LoRA gradients with and without it, and fewer
activations kept for the backward pass (``omnirl_core.testing.kept_for_backward_bytes``: what autograd saves
outside the checkpointed layers plus each layer's inputs; CPU torch has no allocator statistics)."""

from __future__ import annotations

import pytest
import torch
from omnirl_plugin_bagel.model import BagelOptions, create_model
from omnirl_plugin_bagel.tiny import save_tiny

from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.flow.sampler import step_mean, transition_logprob
from omnirl_core.testing import kept_for_backward_bytes


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    path = save_tiny(tmp_path_factory.mktemp("bagel-tiny"), seed=3)
    out = {}
    for checkpointing in (False, True):
        model = create_model(ModelSection(name="bagel", preset="tiny", path=str(path)),
                             BagelOptions(gradient_checkpointing=checkpointing), "cpu")
        model.setup_training(LoraConfig(enabled=True, rank=4, alpha=4), need_reference=False)
        assert model.denoiser.gradient_checkpointing == checkpointing
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # the same non-zero adapter in both, so that every LoRA matrix gets a gradient
            for p in model.trainable_parameters():
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        out[checkpointing] = model
    return out


def _loss(model, size: int) -> torch.Tensor:
    """The Flow-SDE log-prob of a fixed transition, CFG on: what every policy-gradient loss is made of."""
    g = torch.Generator().manual_seed(1)
    shape = (2, *model.latent_shape(size, size))
    x, x_next = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    s, s_next = torch.tensor([0.9, 0.5]), torch.tensor([0.8, 0.4])
    cond = model.encode(["a red square", "a blue car, photo"])
    v = model.velocity(x, s, cond, 4.0, model.encode([" ", " "]))
    mean, std = step_mean("sde", x, v, s, s_next, 0.7)
    return -transition_logprob("sde", x_next, mean, std).mean()


def test_checkpointing_gives_the_same_loss_and_gradients(models):
    results = []
    for checkpointing in (False, True):
        model = models[checkpointing]
        model.denoiser.zero_grad(set_to_none=True)
        loss = _loss(model, 64)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.denoiser.named_parameters()
                                        if p.requires_grad}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-5)
    assert grads_a.keys() == grads_b.keys() and all(g.abs().sum() > 0 for g in grads_a.values())
    for name, a in grads_a.items():
        torch.testing.assert_close(grads_b[name], a, rtol=1e-5, atol=1e-5, msg=name)


def test_checkpointing_keeps_fewer_activations_for_the_backward_pass(models):
    kept = {c: kept_for_backward_bytes([m.denoiser], list(m.denoiser.layers), lambda m=m: _loss(m, 128).backward())
            for c, m in models.items()}
    assert kept[True] < 0.5 * kept[False], kept
