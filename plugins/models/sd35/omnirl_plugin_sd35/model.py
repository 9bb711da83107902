"""Stable Diffusion 3.5 (Medium / Large) behind the omnirl flow-model contract, on diffusers'
StableDiffusion3Pipeline components.

Conditioning is what the pipeline feeds its MMDiT: the two CLIP hidden states concatenated and padded to the
T5 width, followed by the T5 states (zeros when the T5 encoder is left out), and the two pooled CLIP
projections. Latents are (16, H/8, W/8) per sample; ``velocity`` hands them to the transformer as they are
(it patchifies them itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.errors import UsageError
from omnirl_core.flow.model import DTYPES, DenoiserModel, load_diffusers_pipeline
from omnirl_core.interfaces import Conditioning
from omnirl_core.presets import atomic_directory, cache_dir, checkpoint_path

HUB_IDS = {"medium": "stabilityai/stable-diffusion-3.5-medium", "large": "stabilityai/stable-diffusion-3.5-large"}


class SD35Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    layout: Literal["medium", "large"] = Field(
        "medium", description="medium: MMDiT-X (dual attention layers), 2.5B; large: MMDiT, 8B. Picks the "
        "default checkpoint and the tiny architecture; a loaded checkpoint must match it."
    )
    use_t5: bool = Field(
        True, description="Load and run the T5-XXL text encoder. False leaves it out (its part of the prompt "
        "embedding is zeros, as in the pipeline): about 9 GB less memory, weaker text following."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each transformer block's activations in the backward pass (less training "
        "memory at high resolution, about a third more compute; same numbers)."
    )
    max_sequence_length: int = Field(256, ge=1, le=512, description="T5 prompt tokens (CLIP always uses 77).")
    tiny_seed: int = Field(0, description="Seed of the tiny preset's random weights.")


class SD35Model(DenoiserModel):
    capabilities = frozenset({"flow-matching", "sde-logprob", "cfg", "lora", "image"})
    # joint attention (image and prompt streams), MMDiT-X's second image attention (attn2.*, matched by the
    # same names) and both feed-forwards
    default_lora_targets = (
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    )

    def __init__(self, pipeline: Any, options: SD35Options, device: torch.device, dtype: torch.dtype):
        super().__init__(pipeline, pipeline.transformer, device, dtype)
        self.options = options
        self.vae_scale = pipeline.vae_scale_factor
        self.patch = pipeline.transformer.config.patch_size
        self.channels = pipeline.transformer.config.in_channels
        self.num_train_timesteps = pipeline.scheduler.config.num_train_timesteps

    def setup_training(self, lora: LoraConfig, need_reference: bool) -> None:
        super().setup_training(lora, need_reference)
        if self.options.gradient_checkpointing:
            self.denoiser.enable_gradient_checkpointing()

    def frozen_modules(self) -> list[torch.nn.Module]:
        p = self.pipeline
        return [m for m in (p.text_encoder, p.text_encoder_2, p.text_encoder_3, p.vae) if m is not None]

    # -- contract ------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=list(prompts), prompt_2=None, prompt_3=None, device=self.device,
            do_classifier_free_guidance=False, max_sequence_length=self.options.max_sequence_length,
        )
        return Conditioning({"prompt_embeds": embeds.to(self.dtype), "pooled_prompt_embeds": pooled.to(self.dtype)})

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        multiple = self.vae_scale * self.patch
        if height % multiple or width % multiple:
            raise UsageError(
                f"SD3.5 needs height and width divisible by {multiple}; got {height}x{width}.",
                hint=f"Set rollout.height/width to multiples of {multiple}.",
            )
        if num_frames not in (None, 1):
            raise UsageError("SD3.5 generates images; rollout.num_frames must be unset.")
        return (self.channels, height // self.vae_scale, width // self.vae_scale)

    def sigmas(self, num_steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """The pipeline's schedule: FlowMatchEuler's shifted sigmas (size-dependent mu when the checkpoint's
        scheduler shifts dynamically), then 0."""
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

        scheduler = self.pipeline.scheduler
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", False):
            seq_len = (latent_shape[-2] // self.patch) * (latent_shape[-1] // self.patch)
            kwargs["mu"] = calculate_shift(
                seq_len,
                scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
        return torch.as_tensor(np.asarray(scheduler.sigmas), dtype=torch.float32).clone()

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        out = self.denoiser(
            hidden_states=x,
            timestep=sigma.float() * self.num_train_timesteps,
            encoder_hidden_states=cond.tensors["prompt_embeds"].to(self.dtype),
            pooled_projections=cond.tensors["pooled_prompt_embeds"].to(self.dtype),
            return_dict=False,
        )[0]
        return out.float()

    def velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        guidance_scale: float = 1.0,
        uncond: Conditioning | None = None,
    ) -> torch.Tensor:
        x = latents.to(self.device, self.dtype)
        sigma = sigma.to(self.device)
        v = self._forward(x, sigma, cond)
        if guidance_scale > 1.0:
            if uncond is None:
                raise ValueError("CFG needs the unconditional conditioning")
            with torch.no_grad():  # the unconditional branch is detached in training
                v_u = self._forward(x, sigma, uncond)
            v = v_u + guidance_scale * (v - v_u)
        return v

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        z = latents.to(self.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(z, return_dict=False)[0]
        return ((images.float() + 1) / 2).clamp(0, 1).cpu()

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] -> latents (B, 16, H / 8, W / 8), the inverse of ``decode``: the VAE
        posterior's mean (deterministic), shifted and scaled as the pipeline does, fp32."""
        vae = self.pipeline.vae
        z = vae.encode(images.to(self.device, vae.dtype) * 2 - 1).latent_dist.mean
        return ((z - vae.config.shift_factor) * vae.config.scaling_factor).float()


def _tiny_directory(layout: str, seed: int) -> Path:
    from omnirl_plugin_sd35.tiny import TINY_VERSION, save_tiny

    target = cache_dir() / "presets" / f"sd3.5-{layout}-tiny-v{TINY_VERSION}-seed{seed}"
    return atomic_directory(target, lambda tmp: save_tiny(tmp, layout=layout, seed=seed))


def load_pipeline(path: str, dtype: torch.dtype, use_t5: bool = True):
    """``StableDiffusion3Pipeline.from_pretrained`` on a local directory or a hub id, with a clear error.
    ``use_t5=False`` does not load the T5 encoder at all."""
    from diffusers import StableDiffusion3Pipeline

    without_t5 = {} if use_t5 else {"text_encoder_3": None, "tokenizer_3": None}
    return load_diffusers_pipeline(
        StableDiffusion3Pipeline, path, dtype, "SD3.5",
        access_note="The released SD3.5 checkpoints are gated: accept the licence on the hub and log in first.",
        **without_t5,
    )


def check_layout(pipeline: Any, layout: str, path: str) -> None:
    """Medium has MMDiT-X blocks (dual attention layers), Large has none; the options must say which."""
    dual = bool(pipeline.transformer.config.dual_attention_layers)
    if dual != (layout == "medium"):
        found = "medium (MMDiT-X, dual attention layers)" if dual else "large (MMDiT, no dual attention)"
        raise UsageError(
            f"The SD3.5 checkpoint at '{path}' has the {found} layout, but model.options.layout is '{layout}'.",
            hint=f"Set model.options.layout={'medium' if dual else 'large'}.",
        )


def create_model(section: ModelSection, options: SD35Options | None, device: Any) -> SD35Model:
    options = options or SD35Options()
    dtype = DTYPES[section.dtype]
    path = checkpoint_path(section, "sd3.5", lambda: _tiny_directory(options.layout, options.tiny_seed),
                           HUB_IDS[options.layout])
    pipeline = load_pipeline(path, dtype, options.use_t5)
    check_layout(pipeline, options.layout, path)
    pipeline = pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    return SD35Model(pipeline, options, torch.device(device), dtype)
