"""Stable Diffusion 3.5 (Medium / Large) behind the omnirl flow-model contract, on diffusers'
StableDiffusion3Pipeline components.

Conditioning is what the pipeline feeds its MMDiT: the two CLIP hidden states concatenated and padded to the
T5 width, followed by the T5 states (zeros when the T5 encoder is left out), and the two pooled CLIP
projections. Latents are (16, H/8, W/8) per sample; ``velocity`` hands them to the transformer as they are
(it patchifies them itself).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
from pydantic import Field

from omnirl_core.config import ModelSection
from omnirl_core.contracts import Conditioning
from omnirl_core.flow.model import (
    DiffusersFlowModel,
    DiffusersModelOptions,
    check_checkpoint_layout,
    create_flow_model,
    load_diffusers_pipeline,
)

ACCESS_NOTE = "The released SD3.5 checkpoints are gated: accept the licence on the hub and log in first."
HUB_IDS = {"medium": "stabilityai/stable-diffusion-3.5-medium", "large": "stabilityai/stable-diffusion-3.5-large"}


class SD35Options(DiffusersModelOptions):
    layout: Literal["medium", "large"] = Field(
        "medium", description="medium: MMDiT-X (dual attention layers), 2.5B; large: MMDiT, 8B. Picks the "
        "default checkpoint and the tiny architecture; a loaded checkpoint must match it."
    )
    use_t5: bool = Field(
        True, description="Load and run the T5-XXL text encoder. False leaves it out (its part of the prompt "
        "embedding is zeros, as in the pipeline): about 9 GB less memory, weaker text following."
    )
    max_sequence_length: int = Field(256, ge=1, le=512, description="T5 prompt tokens (CLIP always uses 77).")


class SD35Model(DiffusersFlowModel):
    label = "SD3.5"
    capabilities = frozenset({"flow-matching", "sde-logprob", "cfg", "lora", "image"})
    # joint attention (image and prompt streams), MMDiT-X's second image attention (attn2.*, matched by the
    # same names) and both feed-forwards
    default_lora_targets = (
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    )

    def __init__(self, pipeline: Any, options: SD35Options, device: torch.device, dtype: torch.dtype):
        super().__init__(pipeline, options, device, dtype)
        self.patch = pipeline.transformer.config.patch_size
        self.num_train_timesteps = pipeline.scheduler.config.num_train_timesteps

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=list(prompts), prompt_2=None, prompt_3=None, device=self.device,
            do_classifier_free_guidance=False, max_sequence_length=self.options.max_sequence_length,
        )
        return Conditioning({"prompt_embeds": embeds.to(self.dtype), "pooled_prompt_embeds": pooled.to(self.dtype)})

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, grid: tuple[int, int],
                guidance: float | None) -> torch.Tensor:
        out = self.denoiser(
            hidden_states=x,
            timestep=sigma.float() * self.num_train_timesteps,
            encoder_hidden_states=cond.tensors["prompt_embeds"].to(self.dtype),
            pooled_projections=cond.tensors["pooled_prompt_embeds"].to(self.dtype),
            return_dict=False,
        )[0]
        return out.float()


def load_pipeline(path: str, dtype: torch.dtype, use_t5: bool = True):
    """``StableDiffusion3Pipeline.from_pretrained`` on a local directory or a hub id, with a clear error.
    ``use_t5=False`` does not load the T5 encoder at all."""
    from diffusers import StableDiffusion3Pipeline

    without_t5 = {} if use_t5 else {"text_encoder_3": None, "tokenizer_3": None}
    return load_diffusers_pipeline(StableDiffusion3Pipeline, path, dtype, "SD3.5", ACCESS_NOTE, **without_t5)


def check_layout(pipeline: Any, layout: str, path: str) -> None:
    """Medium has MMDiT-X blocks (dual attention layers), Large has none; the options must say which."""
    if pipeline.transformer.config.dual_attention_layers:
        check_checkpoint_layout("SD3.5", path, layout, "medium", "MMDiT-X, dual attention layers")
    else:
        check_checkpoint_layout("SD3.5", path, layout, "large", "MMDiT, no dual attention")


def create_model(section: ModelSection, options: SD35Options | None, device: Any) -> SD35Model:
    from diffusers import StableDiffusion3Pipeline

    from omnirl_plugin_sd35.tiny import TINY_VERSION, build_tiny_pipeline

    options = options or SD35Options()
    without_t5 = {} if options.use_t5 else {"text_encoder_3": None, "tokenizer_3": None}
    return create_flow_model(
        SD35Model, StableDiffusion3Pipeline, section, options, device, label="SD3.5",
        default=HUB_IDS[options.layout], access_note=ACCESS_NOTE,
        tiny=(f"sd3.5-{options.layout}", TINY_VERSION, functools.partial(build_tiny_pipeline, options.layout)),
        check=lambda pipeline, path: check_layout(pipeline, options.layout, path), **without_t5,
    )
