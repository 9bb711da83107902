"""Gradient checkpointing on the tiny presets (``omnirl_core.testing``'s checks): the same loss and gradients
with and without it (both experts of A14B, and TI2V-5B), and fewer activations kept for the backward pass on a
longer video (CPU torch has no allocator statistics: ``kept_for_backward_bytes``); on a GPU, a lower
``torch.cuda.max_memory_allocated``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omnirl_plugin_wan22.model import Wan22Options, create_model
from omnirl_plugin_wan22.tiny import save_tiny

from omnirl_core import testing
from omnirl_core.config import ModelSection

LAYOUTS = ("a14b", "ti2v-5b")


def _build(path: Path, layout: str):
    """``create_model``, the model section, and the options by ``checkpointing``."""
    options = lambda c: Wan22Options(layout=layout, max_sequence_length=16, gradient_checkpointing=c)
    return create_model, ModelSection(name="wan2.2", preset="tiny", path=str(path)), options


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return {layout: testing.checkpointing_pair(*_build(save_tiny(tmp_path_factory.mktemp(f"wan-{layout}"),
                                                                 layout=layout, seed=3), layout))
            for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpointing_gives_the_same_loss_and_gradients(models, layout: str):
    # sigma 0.9 and 0.5: both A14B experts; every adapter matrix of every trained expert gets a gradient
    testing.check_checkpointed_gradients(models[layout][False], models[layout][True], 16, num_frames=5,
                                         min_nonzero=1.0)


def test_checkpointing_keeps_far_fewer_activations_for_the_backward_pass(models):
    testing.check_checkpointing_keeps_fewer_activations(
        models["a14b"][False], models["a14b"][True],
        lambda m: [b for name in m.trained for b in m.experts[name].blocks], 32, num_frames=9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_checkpointing_lowers_peak_gpu_memory(tmp_path: Path):
    path = save_tiny(tmp_path / "a14b", layout="a14b", seed=3)
    create, section, options = _build(path, "a14b")
    testing.check_checkpointing_lowers_peak_gpu_memory(
        lambda c: testing.with_same_adapter(create(section, options(c), "cuda")), 64, num_frames=17)
