"""Wan2.2 (T2V-A14B, TI2V-5B) for the memory planner (``omnirl plan``): the full-size architecture on ``meta`` at
the configured layout, resolution, frames and prompt length. See omnirl_core.planning."""

from __future__ import annotations

import functools
from typing import Any

import torch

from omnirl_core.planning import model as plan
from omnirl_core.planning.activations import DenoiserProbe
from omnirl_plugin_wan22.full_size import TEXT_ENCODER, TRANSFORMERS, VAES, full_size_components

# (spatial, temporal) VAE compression of each layout's VAE
SCALES = {"a14b": (8, 4), "ti2v-5b": (16, 4)}
EXPERTS = {"both": ("transformer", "transformer_2"), "high": ("transformer",), "low": ("transformer_2",)}


@functools.lru_cache(maxsize=2)
def _components(layout: str) -> dict[str, torch.nn.Module]:
    return full_size_components(layout)  # meta: no memory to keep


def _latent(config: Any, layout: str) -> tuple[int, int, int]:
    spatial, temporal = SCALES[layout]
    frames = ((config.rollout.num_frames or 1) - 1) // temporal + 1
    return frames, config.rollout.height // spatial, config.rollout.width // spatial


def probe(config: Any, options: Any) -> DenoiserProbe:
    """One expert (they are alike, one runs per call); per-token timesteps for TI2V-5B, as the model passes them."""
    from diffusers import WanTransformer3DModel

    from omnirl_plugin_wan22.model import Wan22Model

    layout = getattr(options, "layout", "a14b")
    arch = TRANSFORMERS[layout]
    dtype = plan.torch_dtype(config)
    frames, h, w = _latent(config, layout)
    tokens = frames * (h // 2) * (w // 2)
    text = getattr(options, "max_sequence_length", 512)
    _, targets = plan.lora_settings(config, Wan22Model.default_lora_targets)

    def inputs(module: torch.nn.Module, batch: int) -> dict[str, Any]:
        meta = {"device": "meta", "dtype": dtype}
        timestep = torch.empty(batch, tokens, **meta) if layout == "ti2v-5b" else torch.empty(batch, **meta)
        return {"hidden_states": torch.empty(batch, arch["in_channels"], frames, h, w, **meta),
                "timestep": timestep,
                "encoder_hidden_states": torch.empty(batch, text, TEXT_ENCODER["d_model"], **meta),
                "return_dict": False}

    return DenoiserProbe(build=plan.layers_builder(WanTransformer3DModel, arch, dtype), layers=arch["num_layers"],
                         blocks=lambda m: m.blocks, inputs=inputs, lora_targets=targets, key=("wan2.2", layout, str(dtype), frames, h, w, text, targets))


def decoder(config: Any, options: Any) -> plan.DecoderProbe:
    from diffusers import AutoencoderKLWan

    layout = getattr(options, "layout", "a14b")
    dtype = plan.torch_dtype(config)
    frames, h, w = _latent(config, layout)
    return plan.vae_decoder(lambda: plan.on_meta(lambda: AutoencoderKLWan(**VAES[layout]), dtype),
                            (VAES[layout]["z_dim"], frames, h, w), dtype,
                            key=("wan2.2", layout, str(dtype), frames, h, w))


def sizing(config: Any, options: Any) -> plan.ModelSizing:
    from omnirl_plugin_wan22.model import Wan22Model

    layout = getattr(options, "layout", "a14b")
    components = _components(layout)
    trained = EXPERTS[getattr(options, "train_experts", "both")] if layout == "a14b" else ("transformer",)
    out = plan.pipeline_sizing(config, components, trained, Wan22Model.default_lora_targets,
                               components["transformer"].blocks, ("text_encoder", "vae"),
                               probe(config, options), decoder(config, options))
    # Ulysses sequence parallelism splits the self-attention's heads over the group (the tokens elsewhere)
    out.parallel_units["sequence"] = (int(components["transformer"].config.num_attention_heads), "attention heads")
    return out
