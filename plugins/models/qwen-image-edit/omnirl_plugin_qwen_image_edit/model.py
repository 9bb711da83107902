"""Qwen-Image-Edit and Qwen-Image-Edit-Plus behind the omnirl flow-model contract, on diffusers' edit pipelines.

What an edit adds to Qwen-Image (the kit ``DiffusersFlowModel`` does the rest: 2x2 packing, the size-shifted schedule,
true CFG with the norm rescale, the VAE's per-channel statistics), as ``QwenImageEditPipeline`` /
``QwenImageEditPlusPipeline`` do it:

- each condition image is resized, keeping its aspect, to ``vae_image_area`` pixels (sides multiples of 32), encoded
  by the VAE (the posterior's mode), normalised and packed into 2x2 tokens; ``velocity`` appends those tokens to the
  noisy ones (the transformer attends over both; ``img_shapes`` places each image in its own RoPE frame) and keeps
  the output of the noisy ones;
- the Qwen2.5-VL text encoder reads the instruction with the images (Edit: the same resized image inline; Edit-Plus:
  "Picture i:" per image, resized to ``vl_image_area``), so the prompt embedding depends on the images too;
- true CFG encodes the negative prompt with the same images, and both branches see the image tokens.

The condition (prompt embedding, image latents, their grids as the ``Conditioning.layout``) is computed once per
(prompt, images) and carried with every sample (``Sample.cond``), so the trainer re-evaluates with the rollout's own
numbers. Latents are kept unpacked, (C, H, W) per sample, as for Qwen-Image.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import Field

from omnirl_core.config import ModelSection
from omnirl_core.contracts import Conditioning, GenRequest
from omnirl_core.data.images import load_image
from omnirl_core.errors import UsageError
from omnirl_core.flow.model import (
    DTYPES,
    DiffusersFlowModel,
    DiffusersModelOptions,
    load_diffusers_pipeline,
    pack_2x2,
)

DEFAULT_HUB_ID = "Qwen/Qwen-Image-Edit-2509"
LAYOUTS = {"QwenImageEditPlusPipeline": "edit-plus", "QwenImageEditPipeline": "edit"}
MAX_IMAGES = {"edit-plus": 3, "edit": 1}
"""Condition images per prompt: Edit-Plus (2509 / 2511) is trained on one to three."""


class QwenImageEditOptions(DiffusersModelOptions):
    vae_image_area: int = Field(
        1024 * 1024, ge=32 * 32, description="Pixels of each condition image as the VAE encodes it (its aspect kept, "
        "sides multiples of 32): the pipelines' 1024 x 1024. Condition tokens cost attention like output tokens.")
    vl_image_area: int = Field(
        384 * 384, ge=32 * 32, description="Edit-Plus: pixels of each condition image as the text encoder's vision "
        "tower sees it (the pipeline's 384 x 384). The Edit layout shows it the VAE's image.")
    cfg_renorm: bool = Field(
        True, description="Rescale the CFG prediction to the conditional one's norm per token (the pipelines' true CFG).")
    tiny_variant: Literal["edit-plus", "edit"] = Field(
        "edit-plus", description="The tiny preset's pipeline: edit-plus (QwenImageEditPlusPipeline, one to three "
        "condition images) or edit (QwenImageEditPipeline, one).")


def image_dimensions(area: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) of an image resized to about ``area`` pixels with its aspect kept, sides multiples of 32: the
    edit pipelines' ``calculate_dimensions``."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    w, h = calculate_dimensions(area, width / height)
    return int(w), int(h)


class QwenImageEditModel(DiffusersFlowModel):
    label = "Qwen-Image-Edit"
    capabilities = frozenset({"flow-matching", "sde-logprob", "cfg", "lora", "image", "image-input"})
    packed = linspace_sigmas = video_vae = True
    # both streams of the joint attention and both MLPs (Qwen-Image's targets)
    default_lora_targets = (
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    )

    def __init__(self, pipeline: Any, options: QwenImageEditOptions, device: torch.device, dtype: torch.dtype):
        super().__init__(pipeline, options, device, dtype)
        self.options: QwenImageEditOptions = options
        self.cfg_renorm = options.cfg_renorm
        self.layout = LAYOUTS[type(pipeline).__name__]
        self.condition_images = MAX_IMAGES[self.layout]

    # -- condition images -----------------------------------------------------------------------------------
    def _sizes(self, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((w, h) the VAE encodes, (w, h) the vision tower sees) for a source of ``width`` x ``height``."""
        vae = image_dimensions(self.options.vae_image_area, width, height)
        return vae, image_dimensions(self.options.vl_image_area, width, height) if self.layout == "edit-plus" else vae

    def _grid(self, vae_size: tuple[int, int]) -> tuple[int, int]:
        """The packed token grid (rows, columns) of a condition image the VAE encodes at ``vae_size`` (w, h)."""
        return vae_size[1] // self.vae_scale // 2, vae_size[0] // self.vae_scale // 2

    def condition_key(self, request: GenRequest) -> tuple[tuple[int, int], ...] | None:
        paths = request.condition_images
        if not paths:
            return None
        from PIL import Image

        grids = []
        for path in paths:
            with Image.open(path) as image:  # the header: no decoding
                grids.append(self._grid(self._sizes(*image.size)[0]))
        return tuple(grids)

    def encode(self, prompts: list[str]) -> Conditioning:
        """Text-only conditioning (Edit-Plus generates without a source too; the Edit layout needs one)."""
        return Conditioning.cat(self.encode_with_images(prompts, [()] * len(prompts)))

    @torch.no_grad()
    def encode_with_images(self, prompts: list[str], images: Sequence[Sequence[str]]) -> list[Conditioning]:
        return [self._encode_one(p, tuple(i)) for p, i in zip(prompts, images)]

    def _encode_one(self, prompt: str, paths: tuple[str, ...]) -> Conditioning:
        """One prompt with its images: the pipeline's own preprocessing (``image_processor.resize`` for the vision
        tower, ``preprocess`` for the VAE), prompt embedding and VAE encoding."""
        if len(paths) > self.condition_images or (self.layout == "edit" and not paths):
            raise UsageError(
                f"{self.label} ({self.layout} layout) takes {'one' if self.layout == 'edit' else 'one to three'} "
                f"condition image(s) per prompt; the prompt {prompt[:60]!r} has {len(paths)}.",
                hint="Give each record that many paths in its 'image' field (Edit-Plus checkpoints take up to three).")
        processor = self.pipeline.image_processor
        vl_images, vae_inputs, grids = [], [], []
        for path in paths:
            source = load_image(path)
            (vw, vh), (cw, ch) = self._sizes(source.width, source.height)
            if self.layout == "edit":  # QwenImageEditPipeline: one resized image for the vision tower and the VAE
                source = processor.resize(source, vh, vw)
            vl_images.append(processor.resize(source, ch, cw) if self.layout == "edit-plus" else source)
            vae_inputs.append(processor.preprocess(source, vh, vw).unsqueeze(2))
            grids.append(self._grid((vw, vh)))
        vl: Any = None
        if vl_images:
            vl = vl_images if self.layout == "edit-plus" else vl_images[0]
        embeds, mask = self._prompt_embeds(prompt, vl)
        tensors = {"prompt_embeds": embeds, "prompt_mask": mask.to(torch.long)}
        if vae_inputs:
            latents = [self.pipeline._encode_vae_image(x.to(self.device, self.dtype), None)[:, :, 0] for x in vae_inputs]
            tensors["image_latents"] = torch.cat([pack_2x2(z) for z in latents], dim=1)
        return Conditioning(tensors, pad_keys=("prompt_embeds", "prompt_mask"), layout=tuple(grids) or None)

    def _prompt_embeds(self, prompt: str, images: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # the pipeline reads only the text encoder's last hidden states: its LM head (a 152k-word vocabulary) need
        # not project every token, so it gets the last position only for the call (as the qwen-image plugin does)
        encoder = self.pipeline.text_encoder
        encoder.forward = functools.partial(type(encoder).forward, encoder, logits_to_keep=1)
        try:
            return self.pipeline._get_qwen_prompt_embeds([prompt], image=images, device=self.device,
                                                         dtype=self.dtype)
        finally:
            del encoder.forward

    # -- the transformer call -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, grid: tuple[int, int],
                guidance: float | None) -> torch.Tensor:
        """One transformer call over the noisy tokens followed by the condition images' (the pipelines'
        ``torch.cat([latents, image_latents], dim=1)``); the noisy tokens' output."""
        mask = cond.tensors["prompt_mask"]
        tokens = x.shape[1]
        shapes = [(1, grid[0] // 2, grid[1] // 2), *((1, h, w) for h, w in (cond.layout or ()))]
        if "image_latents" in cond.tensors:
            x = torch.cat([x, cond.tensors["image_latents"].to(self.dtype)], dim=1)
        out = self.denoiser(
            hidden_states=x,
            timestep=sigma.to(self.dtype),
            encoder_hidden_states=cond.tensors["prompt_embeds"].to(self.dtype),
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            img_shapes=[shapes] * x.shape[0],
            return_dict=False,
        )[0]
        return out[:, :tokens].float()


def load_pipeline(path: str, dtype: torch.dtype) -> Any:
    """A Qwen-Image-Edit(-Plus) checkpoint (a local diffusers directory or a hub id) with its processor built from
    the checkpoint's ``processor`` folder (``processor.QwenVLInputs``: no torchvision needed)."""
    from diffusers import DiffusionPipeline

    from omnirl_plugin_qwen_image_edit.processor import QwenVLInputs

    pipeline = load_diffusers_pipeline(DiffusionPipeline, path, dtype, "Qwen-Image-Edit", processor=None)
    if type(pipeline).__name__ not in LAYOUTS:
        raise UsageError(
            f"'{path}' holds a {type(pipeline).__name__}, not a Qwen-Image-Edit checkpoint "
            f"({' or '.join(LAYOUTS)}).",
            hint="Point model.path at Qwen/Qwen-Image-Edit, Qwen/Qwen-Image-Edit-2509 (or 2511), or use --preset tiny.")
    pipeline.register_modules(processor=QwenVLInputs.load(path, pipeline.tokenizer))
    return pipeline


def tiny_path(options: QwenImageEditOptions) -> str:
    """The tiny preset's directory (built and saved once, then loaded like a released checkpoint)."""
    from omnirl_core.presets import atomic_directory, cache_dir
    from omnirl_plugin_qwen_image_edit.tiny import TINY_VERSION, save_tiny

    name = f"qwen-image-{options.tiny_variant}-tiny-v{TINY_VERSION}-seed{options.tiny_seed}"
    return str(atomic_directory(cache_dir() / "presets" / name,
                                lambda tmp: save_tiny(tmp, options.tiny_variant, options.tiny_seed)))


def create_model(section: ModelSection, options: QwenImageEditOptions | None, device: Any) -> QwenImageEditModel:
    from omnirl_core.precision import concrete_dtype
    from omnirl_core.presets import checkpoint_path

    options = options or QwenImageEditOptions()
    dtype = DTYPES[concrete_dtype(section.dtype, torch.device(device).type) if section.dtype == "auto" else section.dtype]
    path = checkpoint_path(section, section.name or "qwen-image-edit", lambda: tiny_path(options), DEFAULT_HUB_ID)
    pipeline = load_pipeline(path, dtype).to(device)
    pipeline.set_progress_bar_config(disable=True)
    return QwenImageEditModel(pipeline, options, torch.device(device), dtype)
