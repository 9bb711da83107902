"""SD3.5 (Medium / Large) for the memory planner (``omnirl plan``): the full-size architecture on ``meta`` at the
configured layout, resolution and prompt length. See omnirl_core.planning."""

from __future__ import annotations

import functools
from typing import Any

import torch

from omnirl_core.planning import model as plan
from omnirl_core.planning.activations import DenoiserProbe
from omnirl_plugin_sd35.full_size import TRANSFORMERS, VAE, full_size_components

VAE_SCALE = 8
CLIP_TOKENS = 77


@functools.lru_cache(maxsize=2)
def _components(layout: str) -> dict[str, torch.nn.Module]:
    return full_size_components(layout)  # meta: no memory to keep


def probe(config: Any, options: Any) -> DenoiserProbe:
    """The transformer; prompts of 77 CLIP + ``max_sequence_length`` T5 tokens (zeros without T5, as the
    pipeline pads them)."""
    from diffusers import SD3Transformer2DModel

    from omnirl_plugin_sd35.model import SD35Model

    layout = getattr(options, "layout", "medium")
    arch = TRANSFORMERS[layout]
    dtype = plan.torch_dtype(config)
    h, w = config.rollout.height // VAE_SCALE, config.rollout.width // VAE_SCALE
    text = CLIP_TOKENS + getattr(options, "max_sequence_length", 256)
    _, targets = plan.lora_settings(config, SD35Model.default_lora_targets)

    def build(layers: int) -> torch.nn.Module:
        dual = tuple(i for i in arch["dual_attention_layers"] if i < layers)
        shape = {**arch, "num_layers": layers, "dual_attention_layers": dual}
        return plan.on_meta(lambda: SD3Transformer2DModel(**shape), dtype)

    def inputs(module: torch.nn.Module, batch: int) -> dict[str, Any]:
        meta = {"device": "meta", "dtype": dtype}
        return {"hidden_states": torch.empty(batch, arch["in_channels"], h, w, **meta),
                "encoder_hidden_states": torch.empty(batch, text, arch["joint_attention_dim"], **meta),
                "pooled_projections": torch.empty(batch, arch["pooled_projection_dim"], **meta),
                "timestep": torch.empty(batch, **meta), "return_dict": False}

    # Medium's first 13 of 24 blocks carry a second (dual) attention: the one- and two-block traces are of dual
    # blocks, which over- rather than underestimates the other 11
    return DenoiserProbe(build=build, layers=arch["num_layers"], blocks=lambda m: m.transformer_blocks,
                         inputs=inputs, lora_targets=targets,
                         key=("sd3.5", layout, str(dtype), h, w, text, targets))


def decoder(config: Any) -> plan.DecoderProbe:
    from diffusers import AutoencoderKL

    dtype = plan.torch_dtype(config)
    h, w = config.rollout.height // VAE_SCALE, config.rollout.width // VAE_SCALE
    return plan.vae_decoder(lambda: plan.on_meta(lambda: AutoencoderKL(**VAE), dtype), (VAE["latent_channels"], h, w),
                            dtype, key=("sd3.5", str(dtype), h, w))


def sizing(config: Any, options: Any) -> plan.ModelSizing:
    from omnirl_plugin_sd35.model import SD35Model

    components = dict(_components(getattr(options, "layout", "medium")))
    if not getattr(options, "use_t5", True):
        components.pop("text_encoder_3")
    return plan.pipeline_sizing(config, components, ("transformer",), SD35Model.default_lora_targets,
                                components["transformer"].transformer_blocks,
                                ("text_encoder", "text_encoder_2", "text_encoder_3", "vae"),
                                probe(config, options), decoder(config))
