"""FLUX.1 for the memory planner (``omnirl plan``): on ``meta`` at the configured resolution and prompt length, the
released dev or schnell (the preset, or what ``limits`` reads of a local checkpoint's guidance embedding), or the
tiny preset's architecture when the run uses it. See omnirl_core.planning."""

from __future__ import annotations

import functools
from typing import Any

import torch

from omnirl_core.planning import model as plan
from omnirl_core.planning.activations import DenoiserProbe
from omnirl_plugin_flux import full_size, tiny

VAE_SCALE = 8
PATCH = 2  # latents are packed into 2x2 patches: one transformer token each
EMBEDDED_GUIDANCE_NOTE = (
    "FLUX.1-dev's guidance is embedded (rollout.guidance_scale is an input of the transformer: one branch per step, "
    "no unconditional pass): where the activations say 'CFG on', they include an unconditional no-grad pass the run "
    "does not make (an overestimate)")


@functools.lru_cache(maxsize=2)
def _components(variant: str) -> dict[str, torch.nn.Module]:
    return full_size.full_size_components(variant)  # meta: no memory to keep


TINY_CLIP_VOCAB = 504
"""``len(presets.clip_tokenizer())``, the tiny CLIP's vocabulary: training that BPE writes progress lines to stdout,
which a plan (and every run's memory check) must not, so the planner takes its size (tests/test_sizing.py checks
the counts against the tiny pipeline itself)."""


class _ClipVocabulary:
    """What ``presets.tiny_clip_text_encoder`` reads of its tokenizer: the size and the special tokens' ids."""

    bos_token_id, eos_token_id, pad_token_id = 0, 1, 1

    def __len__(self) -> int:
        return TINY_CLIP_VOCAB


@functools.lru_cache(maxsize=2)
def _tiny_components(variant: str) -> dict[str, torch.nn.Module]:
    """The tiny preset's modules on meta."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    from omnirl_core import presets

    t5_tokenizer = presets.t5_tokenizer()  # built, not trained: quick and quiet
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # the builders seed: leave the caller's RNG be
        return {"transformer": FluxTransformer2DModel(**tiny.TRANSFORMER, guidance_embeds=variant == "dev"),
                "vae": AutoencoderKL(**tiny.VAE),
                "text_encoder": presets.tiny_clip_text_encoder(_ClipVocabulary(), tiny.CLIP_DIM, 0),
                "text_encoder_2": presets.tiny_t5_encoder(t5_tokenizer, **tiny.T5, seed=0)}


def variant(config: Any, options: Any) -> str:
    """``dev`` or ``schnell``: the tiny preset's ``tiny_variant``; otherwise whether the checkpoint the run loads
    has a guidance embedding (``limits``: the preset's hub id, or a local checkpoint's transformer config)."""
    from omnirl_plugin_flux import limits

    if config.model.preset == "tiny":
        return getattr(options, "tiny_variant", "dev")
    return "dev" if limits(config.model, options).guidance == "embedded" else "schnell"


def _architecture(config: Any, options: Any) -> tuple[str, str, dict[str, Any], dict[str, Any], int]:
    """(label, variant, transformer config without the guidance switch, VAE config, VAE scale) of the checkpoint
    the run loads."""
    v = variant(config, options)
    if config.model.preset == "tiny":
        return f"flux.1-{v}-tiny-v{tiny.TINY_VERSION}", v, tiny.TRANSFORMER, tiny.VAE, tiny.VAE_SCALE
    return f"flux.1-{v}", v, full_size.TRANSFORMER, full_size.VAE, VAE_SCALE


def probe(config: Any, options: Any, transformer: dict[str, Any] | None = None, condition: int = 0) -> DenoiserProbe:
    """The transformer at its width, ``n`` double-stream blocks with their share of single-stream ones (the
    released 19 + 38: one double and two single a unit); inputs for ``rollout.height x width`` (2x2-packed latent
    tokens) and T5 prompts of ``max_sequence_length`` tokens (the pipeline pads every prompt to it), CLIP's pooled
    embedding, the rotary ids of both, and dev's guidance scale. ``transformer``: another transformer
    configuration (a test's small one) instead of the run's. ``condition``: a Kontext source image's tokens, which
    follow the noisy ones in the sequence."""
    from diffusers import FluxTransformer2DModel

    from omnirl_plugin_flux.model import FluxModel

    label, v, arch, _, scale = _architecture(config, options)
    if transformer is not None:
        label, arch = f"{label}-custom-{sorted(transformer.items())}", transformer
    ratio, rest = divmod(arch["num_single_layers"], arch["num_layers"])
    if rest:
        raise ValueError(f"{label}: {arch['num_single_layers']} single-stream blocks are not a multiple of the "
                         f"{arch['num_layers']} double-stream ones")
    dtype = plan.torch_dtype(config)
    h = config.rollout.height // scale // PATCH
    w = config.rollout.width // scale // PATCH
    text = getattr(options, "max_sequence_length", 512)
    _, targets = plan.lora_settings(config, FluxModel.default_lora_targets)

    def build(units: int) -> torch.nn.Module:
        shape = {**arch, "num_layers": units, "num_single_layers": ratio * units, "guidance_embeds": v == "dev"}
        return plan.on_meta(lambda: FluxTransformer2DModel(**shape), dtype)

    def inputs(module: torch.nn.Module, batch: int) -> dict[str, Any]:
        meta = {"device": "meta", "dtype": dtype}
        return {
            "hidden_states": torch.empty(batch, h * w + condition, arch["in_channels"], **meta),
            "encoder_hidden_states": torch.empty(batch, text, arch["joint_attention_dim"], **meta),
            "pooled_projections": torch.empty(batch, arch["pooled_projection_dim"], **meta),
            "timestep": torch.empty(batch, **meta),
            "img_ids": torch.empty(h * w + condition, 3, **meta),
            "txt_ids": torch.empty(text, 3, **meta),
            # the scale per sample in float32, as the model passes it; schnell has no guidance embedding
            "guidance": torch.empty(batch, device="meta", dtype=torch.float32) if v == "dev" else None,
            "return_dict": False,
        }

    return DenoiserProbe(build=build, layers=arch["num_layers"],
                         blocks=lambda m: [*m.transformer_blocks, *m.single_transformer_blocks],
                         inputs=inputs, lora_targets=targets, key=(label, str(dtype), h, w, condition, text, targets))


def decoder(config: Any, options: Any) -> plan.DecoderProbe:
    """The VAE decode of images at the configured resolution (the unpacked latent grid)."""
    from diffusers import AutoencoderKL

    label, _, _, vae, scale = _architecture(config, options)
    dtype = plan.torch_dtype(config)
    h, w = config.rollout.height // scale, config.rollout.width // scale
    return plan.vae_decoder(lambda: plan.on_meta(lambda: AutoencoderKL(**vae), dtype), (vae["latent_channels"], h, w),
                            dtype, key=(label, str(dtype), h, w))


def sizing(config: Any, options: Any, condition: int = 0) -> plan.ModelSizing:
    from omnirl_core.loop.distributed import shard_units
    from omnirl_plugin_flux.model import FluxModel

    v = variant(config, options)
    tiny_preset = config.model.preset == "tiny"
    components = _tiny_components(v) if tiny_preset else _components(v)
    # the released presets (dev, schnell) are described too, as the hub checkpoints they name: not when model.path
    # names another checkpoint (the run checks that one against the released architecture's size)
    preset = config.model.preset
    if preset != "tiny" and (preset not in full_size.VARIANTS or config.model.path):
        preset = None
    result = plan.pipeline_sizing(config, components, ("transformer",), FluxModel.default_lora_targets,
                                  shard_units(components["transformer"]), ("text_encoder", "text_encoder_2", "vae"),
                                  probe(config, options, condition=condition), decoder(config, options), preset=preset)
    if v == "dev" and config.rollout.guidance_scale > 1.0:
        result.notes.append(EMBEDDED_GUIDANCE_NOTE)
    return result


def kontext_sizing(config: Any, options: Any) -> plan.ModelSizing:
    """FLUX.1 Kontext: FLUX.1-dev's architecture with one source image's tokens after the noisy ones (a square source
    at ``condition_area`` pixels; None: the pipeline's 1024 x 1024)."""
    scale = tiny.VAE_SCALE if config.model.preset == "tiny" else VAE_SCALE
    side = int((getattr(options, "condition_area", None) or 1024 * 1024) ** 0.5) // (scale * PATCH)
    result = sizing(config, options, condition=side * side)
    result.notes.append(f"one source image per prompt: {side * side} transformer tokens")
    return result
