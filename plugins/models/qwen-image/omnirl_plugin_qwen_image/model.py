"""Qwen-Image behind the omnirl flow-model contract, on top of diffusers' QwenImagePipeline components.

Latents are kept unpacked, (C, H, W) per sample, so that the core's sampler and shape buckets see the
latent grid; the kit (``DiffusersFlowModel``) packs them into 2x2 patches for the transformer, applies the
size-dependent shifted schedule, true CFG with the norm rescale, and the VAE's per-channel statistics.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from pydantic import Field

from omnirl_core.config import ModelSection
from omnirl_core.contracts import Conditioning
from omnirl_core.flow.model import (
    DiffusersFlowModel,
    DiffusersModelOptions,
    create_flow_model,
    load_diffusers_pipeline,
)

DEFAULT_HUB_ID = "Qwen/Qwen-Image"


class QwenImageOptions(DiffusersModelOptions):
    max_sequence_length: int = Field(512, ge=1, le=1024, description="Prompt tokens kept after the template.")
    cfg_renorm: bool = Field(
        True, description="Rescale the CFG prediction to the conditional one's norm per token (Qwen-Image's "
        "true CFG)."
    )


class QwenImageModel(DiffusersFlowModel):
    label = "Qwen-Image"
    capabilities = frozenset({"flow-matching", "sde-logprob", "cfg", "lora", "image"})
    packed = linspace_sigmas = video_vae = True
    # both streams of the joint attention and both MLPs: the image stream reads the prompt only through them
    default_lora_targets = (
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    )

    def __init__(self, pipeline: Any, options: QwenImageOptions, device: torch.device, dtype: torch.dtype):
        super().__init__(pipeline, options, device, dtype)
        self.cfg_renorm = options.cfg_renorm

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

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, grid: tuple[int, int],
                guidance: float | None) -> torch.Tensor:
        mask = cond.tensors["prompt_mask"]
        out = self.denoiser(
            hidden_states=x,
            timestep=sigma.to(self.dtype),
            encoder_hidden_states=cond.tensors["prompt_embeds"].to(self.dtype),
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            img_shapes=[[(1, grid[0] // 2, grid[1] // 2)]] * x.shape[0],
            return_dict=False,
        )[0]
        return out.float()


def load_pipeline(path: str, dtype: torch.dtype):
    """``QwenImagePipeline.from_pretrained`` on a local directory or a hub id, with a clear error."""
    from diffusers import QwenImagePipeline

    return load_diffusers_pipeline(QwenImagePipeline, path, dtype, "Qwen-Image")


def create_model(section: ModelSection, options: QwenImageOptions | None, device: Any) -> QwenImageModel:
    from diffusers import QwenImagePipeline

    from omnirl_plugin_qwen_image.tiny import TINY_VERSION, build_tiny_pipeline

    options = options or QwenImageOptions()
    return create_flow_model(
        QwenImageModel, QwenImagePipeline, section, options, device, label="Qwen-Image", default=DEFAULT_HUB_ID,
        tiny=("qwen-image", TINY_VERSION, build_tiny_pipeline),
    )
