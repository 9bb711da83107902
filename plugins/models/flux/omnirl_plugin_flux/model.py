"""FLUX.1 (dev / schnell) behind the omnirl flow-model contract, on diffusers' FluxPipeline components.

Everything a diffusers flow model shares comes from the kit (``DiffusersFlowModel``): latents as the (16, H/8,
W/8) grid packed into 2x2 patches for the transformer, the size-shifted schedule from linspace(1, 1/T), the
VAE's shift and scale. What is FLUX's own: the CLIP (pooled) + T5 (sequence) conditioning, the rotary position
ids of the text and image tokens, and guidance as an input of the network (dev's guidance embedding) rather
than a second, unconditional branch; schnell has neither guidance nor a guidance embedding.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

import torch
from pydantic import Field

from omnirl_core.config import ModelSection
from omnirl_core.contracts import Conditioning
from omnirl_core.flow.model import DiffusersFlowModel, DiffusersModelOptions, create_flow_model
from omnirl_plugin_flux import HUB_IDS


class FluxOptions(DiffusersModelOptions):
    max_sequence_length: int = Field(512, ge=1, le=512, description="T5 prompt tokens (schnell: at most 256).")
    tiny_variant: Literal["dev", "schnell"] = Field(
        "dev", description="The tiny preset's architecture: dev (guidance embedding) or schnell (none).")


class FluxModel(DiffusersFlowModel):
    label = "FLUX.1"
    capabilities = frozenset({"flow-matching", "sde-logprob", "lora", "image"})
    packed = linspace_sigmas = True
    # joint attention of both streams and both feed-forwards (double blocks), attention and MLP-in (single blocks)
    default_lora_targets = (
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
    )

    def __init__(self, pipeline: Any, options: FluxOptions, device: torch.device, dtype: torch.dtype):
        super().__init__(pipeline, options, device, dtype)
        self.guidance = "embedded" if pipeline.transformer.config.guidance_embeds else "none"

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=list(prompts), prompt_2=None, device=self.device, max_sequence_length=self.options.max_sequence_length)
        return Conditioning({"prompt_embeds": embeds.to(self.dtype), "pooled_prompt_embeds": pooled.to(self.dtype)})

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, grid: tuple[int, int],
                guidance: float | None) -> torch.Tensor:
        embeds = cond.tensors["prompt_embeds"].to(self.dtype)
        img_ids = self.pipeline._prepare_latent_image_ids(None, grid[0] // 2, grid[1] // 2, self.device, self.dtype)
        if guidance is not None:  # embedded guidance: the scale per sample, fp32, as FluxPipeline passes it
            guidance = torch.full((x.shape[0],), guidance, device=self.device, dtype=torch.float32)
        out = self.denoiser(
            hidden_states=x,
            timestep=(sigma.float() * 1000).to(self.dtype) / 1000,  # the pipeline's t / 1000, t = 1000 sigma
            guidance=guidance,
            pooled_projections=cond.tensors["pooled_prompt_embeds"].to(self.dtype),
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype),
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return out.float()


def create_model(section: ModelSection, options: FluxOptions | None, device: Any) -> FluxModel:
    from diffusers import FluxPipeline

    from omnirl_plugin_flux.tiny import TINY_VERSION, build_tiny_pipeline

    options = options or FluxOptions()
    return create_flow_model(
        FluxModel, FluxPipeline, section, options, device, label="FLUX.1", default=HUB_IDS["dev"], presets=HUB_IDS,
        access_note="FLUX.1-dev is gated: accept its licence on the hub and log in first.",
        tiny=(f"flux.1-{options.tiny_variant}", TINY_VERSION, partial(build_tiny_pipeline, options.tiny_variant)),
    )
