"""Gradient checkpointing on the tiny preset (``omnirl_core.testing``'s checks, CFG on): the same loss and LoRA
gradients with and without it, and fewer activations kept for the backward pass (``kept_for_backward_bytes``:
what autograd saves outside the checkpointed layers plus each layer's inputs; CPU torch has no allocator
statistics)."""

from __future__ import annotations

import pytest
from omnirl_plugin_bagel.model import BagelOptions, create_model
from omnirl_plugin_bagel.tiny import save_tiny

from omnirl_core import testing
from omnirl_core.config import ModelSection


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    section = ModelSection(name="bagel", preset="tiny", path=str(save_tiny(tmp_path_factory.mktemp("bagel-tiny"), seed=3)))
    return {c: testing.with_same_adapter(create_model(section, BagelOptions(gradient_checkpointing=c), "cpu"))
            for c in (False, True)}


def test_checkpointing_gives_the_same_loss_and_gradients(models):
    testing.check_checkpointed_gradients(models[False], models[True], 64, guidance_scale=4.0, min_nonzero=1.0)


def test_checkpointing_keeps_fewer_activations_for_the_backward_pass(models):
    testing.check_checkpointing_keeps_fewer_activations(models[False], models[True],
                                                        lambda m: list(m.denoiser.layers), 128, guidance_scale=4.0)
