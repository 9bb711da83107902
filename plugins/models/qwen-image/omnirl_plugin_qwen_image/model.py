"""Qwen-Image behind the omnirl flow-model contract, on top of diffusers' QwenImagePipeline components.

Latents are kept unpacked, (C, H, W) per sample, so that the core's sampler and shape buckets see the
latent grid; ``velocity`` packs them into 2x2 patches for the transformer and unpacks its output.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.errors import UsageError
from omnirl_core.flow.model import DenoiserModel
from omnirl_core.interfaces import Conditioning
from omnirl_core.presets import atomic_directory, cache_dir

DEFAULT_HUB_ID = "Qwen/Qwen-Image"


class QwenImageOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_sequence_length: int = Field(512, ge=1, le=1024, description="Prompt tokens kept after the template.")
    cfg_renorm: bool = Field(
        True, description="Rescale the CFG prediction to the conditional one's norm per token (Qwen-Image's "
        "true CFG)."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each transformer block's activations in the backward pass (less training "
        "memory at high resolution, about a third more compute; same numbers)."
    )
    tiny_seed: int = Field(0, description="Seed of the tiny preset's random weights.")


class QwenImageModel(DenoiserModel):
    capabilities = frozenset({"flow-matching", "sde-logprob", "cfg", "lora", "image"})
    # both streams of the joint attention and both MLPs: the image stream reads the prompt only through them
    default_lora_targets = (
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    )

    def __init__(self, pipeline: Any, options: QwenImageOptions, device: torch.device, dtype: torch.dtype):
        super().__init__(pipeline, pipeline.transformer, device, dtype)
        self.options = options
        self.vae_scale = pipeline.vae_scale_factor
        self.z_dim = pipeline.vae.config.z_dim

    def setup_training(self, lora: LoraConfig, need_reference: bool) -> None:
        super().setup_training(lora, need_reference)
        if self.options.gradient_checkpointing:
            self.denoiser.enable_gradient_checkpointing()

    def frozen_modules(self) -> list[torch.nn.Module]:
        return [self.pipeline.text_encoder, self.pipeline.vae]

    # -- contract ------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        # the pipeline reads only the text encoder's last hidden states: its LM head (a 152k-word vocabulary)
        # need not project every prompt token, so it gets the last position only for the call
        encoder = self.pipeline.text_encoder
        encoder.forward = functools.partial(type(encoder).forward, encoder, logits_to_keep=1)
        try:
            embeds, mask = self.pipeline._get_qwen_prompt_embeds(list(prompts), device=self.device, dtype=self.dtype)
        finally:
            del encoder.forward
        limit = self.options.max_sequence_length
        return Conditioning(
            {"prompt_embeds": embeds[:, :limit], "prompt_mask": mask[:, :limit].to(torch.long)},
            pad_keys=("prompt_embeds", "prompt_mask"),
        )

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        multiple = self.vae_scale * 2
        if height % multiple or width % multiple:
            raise UsageError(
                f"Qwen-Image needs height and width divisible by {multiple}; got {height}x{width}.",
                hint=f"Set rollout.height/width to multiples of {multiple}.",
            )
        if num_frames not in (None, 1):
            raise UsageError("Qwen-Image generates images; rollout.num_frames must be unset.")
        return (self.z_dim, height // self.vae_scale, width // self.vae_scale)

    def sigmas(self, num_steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """The pipeline's schedule: linspace(1, 1/T) shifted by the image-size-dependent mu, then 0."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        scheduler = self.pipeline.scheduler
        seq_len = (latent_shape[-2] // 2) * (latent_shape[-1] // 2)
        mu = calculate_shift(
            seq_len,
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps), mu=mu, device="cpu")
        return scheduler.sigmas.to(torch.float32).clone()

    def _pack(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // 2) * (w // 2), c * 4)

    def _unpack(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        b, _, ch = x.shape
        x = x.view(b, h // 2, w // 2, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, ch // 4, h, w)

    def _forward(self, packed: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, h: int, w: int):
        mask = cond.tensors["prompt_mask"]
        out = self.denoiser(
            hidden_states=packed,
            timestep=sigma.to(self.dtype),
            encoder_hidden_states=cond.tensors["prompt_embeds"].to(self.dtype),
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            img_shapes=[[(1, h // 2, w // 2)]] * packed.shape[0],
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
        h, w = latents.shape[-2:]
        packed = self._pack(latents.to(self.device, self.dtype))
        v = self._forward(packed, sigma.to(self.device), cond, h, w)
        if guidance_scale > 1.0:
            if uncond is None:
                raise ValueError("CFG needs the unconditional conditioning")
            with torch.no_grad():  # the unconditional branch is detached in training
                v_u = self._forward(packed, sigma.to(self.device), uncond, h, w)
            combined = v_u + guidance_scale * (v - v_u)
            if self.options.cfg_renorm:
                combined = combined * (v.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
            v = combined
        return self._unpack(v, h, w)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        z = latents.to(self.device, vae.dtype).unsqueeze(2)  # (B, C, 1, H, W)
        mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
        images = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        return ((images.float() + 1) / 2).clamp(0, 1).cpu()

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] -> latents (B, C, H / s, W / s), the inverse layout of ``decode``:
        the VAE posterior's mean (deterministic), normalised by latents_mean / latents_std, fp32."""
        vae = self.pipeline.vae
        x = (images.to(self.device, vae.dtype) * 2 - 1).unsqueeze(2)  # (B, 3, 1, H, W)
        z = vae.encode(x).latent_dist.mean
        mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
        return ((z - mean) / std)[:, :, 0].float()


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _tiny_directory(seed: int) -> Path:
    from omnirl_plugin_qwen_image.tiny import TINY_VERSION, save_tiny

    target = cache_dir() / "presets" / f"qwen-image-tiny-v{TINY_VERSION}-seed{seed}"
    return atomic_directory(target, lambda tmp: save_tiny(tmp, seed=seed))


def load_pipeline(path: str, dtype: torch.dtype):
    """``QwenImagePipeline.from_pretrained`` on a local directory or a hub id, with a clear error."""
    from diffusers import QwenImagePipeline

    from omnirl_core.flow.model import load_diffusers_pipeline

    return load_diffusers_pipeline(QwenImagePipeline, path, dtype, "Qwen-Image")


def create_model(section: ModelSection, options: QwenImageOptions | None, device: Any) -> QwenImageModel:
    options = options or QwenImageOptions()
    dtype = _DTYPES[section.dtype]
    if section.preset == "tiny":
        path = str(_tiny_directory(options.tiny_seed)) if section.path is None else section.path
    elif section.preset is not None:
        raise UsageError(f"Unknown preset '{section.preset}' for qwen-image.", hint="Available presets: tiny.")
    else:
        path = section.path or DEFAULT_HUB_ID
    pipeline = load_pipeline(path, dtype).to(device)
    pipeline.set_progress_bar_config(disable=True)
    return QwenImageModel(pipeline, options, torch.device(device), dtype)
