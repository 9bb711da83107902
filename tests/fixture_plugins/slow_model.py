"""Test plugin: the tiny Qwen-Image whose VAE decode, from the decode call ``SLOW_MODEL_FROM_DECODE`` (env, default
2: the second step's rollout) on, first makes one long native call (a fused attention over
``SLOW_MODEL_TOKENS`` tokens: minutes on a CPU, a few MiB of memory), as a large image's decode does. A Python
signal handler cannot run until such a call returns."""

from __future__ import annotations

import os
from typing import Any

from omnirl_core import hookimpl
from omnirl_core.presets import TINY_IMAGE_DEFAULTS
from omnirl_core.registry import ModelLimits, ModelSpec

DECODES = [0]


def create_model(section: Any, options: Any, device: Any) -> Any:
    import torch
    from omnirl_plugin_qwen_image.model import create_model as qwen_image

    model = qwen_image(section, options, device)
    decode = model.decode
    start = int(os.environ.get("SLOW_MODEL_FROM_DECODE", "2"))
    tokens = int(os.environ.get("SLOW_MODEL_TOKENS", "600000"))

    def slow_decode(latents: Any) -> Any:
        DECODES[0] += 1
        if DECODES[0] >= start:
            q = torch.randn(1, 1, tokens, 16)
            torch.nn.functional.scaled_dot_product_attention(q, q, q)  # one native call of minutes
        return decode(latents)

    model.decode = slow_decode
    return model


@hookimpl
def omnirl_register_models(register):
    register(ModelSpec(
        name="slow-qwen-image", factory="slow_model:create_model",
        config="omnirl_plugin_qwen_image.model:QwenImageOptions",
        capabilities=frozenset({"flow-matching", "sde-logprob", "cfg", "lora", "image"}), presets=("tiny",),
        preset_defaults={"tiny": {**TINY_IMAGE_DEFAULTS, "rewards": [{"name": "color"}]}},
        limits=ModelLimits(size_multiple=8),
        description="the tiny Qwen-Image with a slow decode (tests)"))
