"""Gradient checkpointing on the tiny presets (``omnirl_core.testing``'s checks): the same loss and gradients
with and without it (both layouts), and fewer activations kept for the backward pass at a larger resolution (CPU
torch has no allocator statistics: ``kept_for_backward_bytes``); on a GPU, a lower
``torch.cuda.max_memory_allocated``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omnirl_plugin_sd35.model import SD35Options, create_model
from omnirl_plugin_sd35.tiny import save_tiny

from omnirl_core import testing
from omnirl_core.config import ModelSection

LAYOUTS = ("medium", "large")


def _options(layout: str):
    return lambda c: SD35Options(layout=layout, max_sequence_length=16, gradient_checkpointing=c)


def _section(path: Path) -> ModelSection:
    return ModelSection(name="sd3.5", preset="tiny", path=str(path))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    paths = {layout: save_tiny(tmp_path_factory.mktemp(f"sd35-{layout}"), layout=layout, seed=3) for layout in LAYOUTS}
    return {layout: testing.checkpointing_pair(create_model, _section(paths[layout]), _options(layout))
            for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpointing_gives_the_same_loss_and_gradients(models, layout: str):
    # the last block is context_pre_only (its prompt stream is not computed): no gradient for adapters there
    testing.check_checkpointed_gradients(models[layout][False], models[layout][True], 32)


def test_checkpointing_keeps_far_fewer_activations_for_the_backward_pass(models):
    testing.check_checkpointing_keeps_fewer_activations(models["medium"][False], models["medium"][True],
                                                        lambda m: m.denoiser.transformer_blocks, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_checkpointing_lowers_peak_gpu_memory(tmp_path: Path):
    path = save_tiny(tmp_path / "medium", layout="medium", seed=3)
    testing.check_checkpointing_lowers_peak_gpu_memory(
        lambda c: testing.with_same_adapter(create_model(_section(path), _options("medium")(c), "cuda")), 256)
