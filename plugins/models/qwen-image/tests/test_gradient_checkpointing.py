"""Gradient checkpointing on the tiny preset (``omnirl_core.testing``'s checks): the same loss and gradients with
and without it, and fewer activations kept for the backward pass at a larger resolution (CPU torch has no
allocator statistics: ``kept_for_backward_bytes``); on a GPU, a lower ``torch.cuda.max_memory_allocated``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omnirl_plugin_qwen_image.model import QwenImageOptions, create_model
from omnirl_plugin_qwen_image.tiny import save_tiny

from omnirl_core import testing
from omnirl_core.config import ModelSection


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("qwen-image-tiny"), seed=3)


def _model(tiny_dir: Path, checkpointing: bool, device: str = "cpu"):
    options = QwenImageOptions(gradient_checkpointing=checkpointing)
    return testing.with_same_adapter(
        create_model(ModelSection(name="qwen-image", preset="tiny", path=str(tiny_dir)), options, device))


@pytest.fixture(scope="module")
def models(tiny_dir: Path) -> dict:
    return {checkpointing: _model(tiny_dir, checkpointing) for checkpointing in (False, True)}


def test_checkpointing_gives_the_same_loss_and_gradients(models):
    # the last block's prompt-stream output is never read: its text-query, output and text-MLP adapters get no
    # gradient (or a zero one), in both runs alike
    testing.check_checkpointed_gradients(models[False], models[True], 32)


def test_checkpointing_keeps_far_fewer_activations_for_the_backward_pass(models):
    testing.check_checkpointing_keeps_fewer_activations(models[False], models[True],
                                                        lambda m: m.denoiser.transformer_blocks, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_checkpointing_lowers_peak_gpu_memory(tiny_dir: Path):
    testing.check_checkpointing_lowers_peak_gpu_memory(lambda c: _model(tiny_dir, c, device="cuda"), 256)
