"""FLUX.1 (dev / schnell) and FLUX.1 Kontext behind the omnirl flow-model contract, on diffusers' FluxPipeline and
FluxKontextPipeline components.

Everything a diffusers flow model shares comes from the kit (``DiffusersFlowModel``): latents as the (16, H/8,
W/8) grid packed into 2x2 patches for the transformer, the size-shifted schedule from linspace(1, 1/T), the
VAE's shift and scale. What is FLUX's own: the CLIP (pooled) + T5 (sequence) conditioning, the rotary position
ids of the text and image tokens, and guidance as an input of the network (dev's guidance embedding) rather
than a second, unconditional branch; schnell has neither guidance nor a guidance embedding.

Kontext (``FluxKontextModel``) is FLUX.1-dev's architecture trained to edit: the source image's VAE latents, packed
like the noisy ones, follow them in the transformer's sequence with rotary ids in a second frame (first id 1), and
the noisy tokens' output is the velocity; the text encoders never see the image.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

import torch
from pydantic import Field

from omnirl_core.config import ModelSection
from omnirl_core.contracts import Conditioning, GenRequest
from omnirl_core.data.images import load_image
from omnirl_core.errors import UsageError
from omnirl_core.flow.model import DiffusersFlowModel, DiffusersModelOptions, create_flow_model, pack_2x2
from omnirl_plugin_flux import HUB_IDS


class FluxTextOptions(DiffusersModelOptions):
    max_sequence_length: int = Field(512, ge=1, le=512, description="T5 prompt tokens (schnell: at most 256).")


class FluxOptions(FluxTextOptions):
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

    def __init__(self, pipeline: Any, options: FluxTextOptions, device: torch.device, dtype: torch.dtype):
        super().__init__(pipeline, options, device, dtype)
        self.guidance = "embedded" if pipeline.transformer.config.guidance_embeds else "none"

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=list(prompts), prompt_2=None, device=self.device, max_sequence_length=self.options.max_sequence_length)
        return Conditioning({"prompt_embeds": embeds.to(self.dtype), "pooled_prompt_embeds": pooled.to(self.dtype)})

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, grid: tuple[int, int],
                guidance: float | None) -> torch.Tensor:
        img_ids = self.pipeline._prepare_latent_image_ids(None, grid[0] // 2, grid[1] // 2, self.device, self.dtype)
        return self._transformer(x, sigma, cond, img_ids, guidance)

    def _transformer(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, img_ids: torch.Tensor,
                     guidance: float | None) -> torch.Tensor:
        """One transformer call over the image tokens ``x`` (rotary ids ``img_ids``) and the prompt, fp32 out."""
        embeds = cond.tensors["prompt_embeds"].to(self.dtype)
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


KONTEXT_HUB_ID = "black-forest-labs/FLUX.1-Kontext-dev"


class FluxKontextOptions(FluxTextOptions):
    condition_area: int | None = Field(
        None, ge=16 * 16, description="Pixels of the source image as the VAE encodes it, its aspect kept (sides "
        "multiples of 16; the tiny preset: 8). None: the pipeline's choice, the Kontext resolution (about 1024 x "
        "1024) nearest the source's aspect. Source tokens cost attention like output tokens.")


class FluxKontextModel(FluxModel):
    label = "FLUX.1 Kontext"
    capabilities = frozenset({"flow-matching", "sde-logprob", "lora", "image", "image-input"})
    condition_images = 1

    def __init__(self, pipeline: Any, options: FluxKontextOptions, device: torch.device, dtype: torch.dtype):
        super().__init__(pipeline, options, device, dtype)
        self.options: FluxKontextOptions = options

    def _source_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the VAE encodes a ``width`` x ``height`` source at: FluxKontextPipeline's preferred
        resolution for its aspect (``condition_area`` None), or that many pixels with the aspect kept; sides
        rounded down to the packing's multiple, as the pipeline does."""
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        multiple = self.vae_scale * 2
        aspect = width / height
        if self.options.condition_area is None:
            _, width, height = min((abs(aspect - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        else:
            width = round((self.options.condition_area * aspect) ** 0.5)
            height = round((self.options.condition_area / aspect) ** 0.5)
        return max(width // multiple, 1) * multiple, max(height // multiple, 1) * multiple

    def condition_key(self, request: GenRequest) -> tuple[tuple[int, int], ...] | None:
        paths = request.condition_images
        if not paths:
            return None
        from PIL import Image

        with Image.open(paths[0]) as image:  # the header: no decoding
            width, height = self._source_size(*image.size)
        return ((height // self.vae_scale // 2, width // self.vae_scale // 2),)

    @torch.no_grad()
    def encode_with_images(self, prompts: list[str], images: Sequence[Sequence[str]]) -> list[Conditioning]:
        """The prompts' text conditioning (CLIP + T5, the image unseen) and each source's packed VAE latents."""
        text = self.encode(list(prompts))
        rows = []
        for i, paths in enumerate(images):
            if len(paths) > 1:
                raise UsageError(f"{self.label} takes one source image per prompt; {prompts[i][:60]!r} has {len(paths)}.",
                                 hint="Give one path in the record's 'image' field (or a model that takes several: "
                                 "qwen-image-edit).")
            row = text.select([i])
            if paths:
                source = load_image(paths[0])
                width, height = self._source_size(source.width, source.height)
                processor = self.pipeline.image_processor
                pixels = processor.preprocess(processor.resize(source, height, width), height, width)
                latents = self.pipeline._encode_vae_image(pixels.to(self.device, self.dtype), None)
                row = Conditioning({**row.tensors, "image_latents": pack_2x2(latents)}, row.pad_keys,
                                   layout=((height // self.vae_scale // 2, width // self.vae_scale // 2),))
            rows.append(row)
        return rows

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, grid: tuple[int, int],
                guidance: float | None) -> torch.Tensor:
        """The noisy tokens followed by the source's (FluxKontextPipeline's ``torch.cat([latents, image_latents],
        dim=1)``, the source's rotary ids with first coordinate 1); the noisy tokens' output."""
        tokens = x.shape[1]
        ids = [self.pipeline._prepare_latent_image_ids(None, grid[0] // 2, grid[1] // 2, self.device, self.dtype)]
        if "image_latents" in cond.tensors:
            for h, w in cond.layout or ():
                source = self.pipeline._prepare_latent_image_ids(None, h, w, self.device, self.dtype)
                source[..., 0] = 1
                ids.append(source)
            x = torch.cat([x, cond.tensors["image_latents"].to(self.dtype)], dim=1)
        return self._transformer(x, sigma, cond, torch.cat(ids), guidance)[:, :tokens]


def create_kontext_model(section: ModelSection, options: FluxKontextOptions | None, device: Any) -> FluxKontextModel:
    from diffusers import FluxKontextPipeline

    from omnirl_plugin_flux.tiny import KONTEXT, KONTEXT_VERSION, build_tiny_pipeline

    options = options or FluxKontextOptions()
    return create_flow_model(
        FluxKontextModel, FluxKontextPipeline, section, options, device, label="FLUX.1 Kontext",
        default=KONTEXT_HUB_ID, access_note="FLUX.1-Kontext-dev is gated: accept its licence on the hub and log in first.",
        tiny=("flux.1-kontext", KONTEXT_VERSION, partial(build_tiny_pipeline, KONTEXT)),
    )
