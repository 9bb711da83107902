"""A small text-to-image flow model for the tests of engine and algorithm plugins, which need a flow model but
must not import a model plugin. Real components with random weights: a CLIP text encoder (``clip_tokenizer``),
diffusers' QwenImage MMDiT (it masks padded prompt tokens, so prompts of any length batch together), a 4-channel
``AutoencoderKL`` (x4) and the size-shifted FlowMatchEuler schedule; latents (4, H/4, W/4), sizes multiples of 8,
true CFG. Built in about a second, nothing saved. ``ToyEditModel`` adds a source image (an editing model's
condition image) to it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from omnirl_core.contracts import Conditioning, GenRequest
from omnirl_core.flow.model import (
    DenoiserModel,
    check_size,
    guided_velocity,
    pack_2x2,
    shifted_sigmas,
    unpack_2x2,
)


class ToyFlowModel(DenoiserModel):
    capabilities = frozenset({"flow-matching", "sde-logprob", "cfg", "lora", "image"})
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj")

    def __init__(self, seed: int = 0, device: str = "cpu"):
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
        from transformers import CLIPTextConfig, CLIPTextModel

        from omnirl_core.presets import clip_tokenizer

        self.tokenizer = clip_tokenizer()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.text_encoder = CLIPTextModel(CLIPTextConfig(
                hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                vocab_size=len(self.tokenizer), max_position_embeddings=77,
                bos_token_id=self.tokenizer.bos_token_id, eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.pad_token_id)).eval()
            transformer = QwenImageTransformer2DModel(
                patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 4, 4))
            self.vae = AutoencoderKL(
                down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                block_out_channels=(16, 32, 32), layers_per_block=1, latent_channels=4, norm_num_groups=8)
        self.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
        super().__init__(None, transformer.to(device), torch.device(device), torch.float32)
        self.text_encoder.to(device)
        self.vae.to(device)

    def frozen_modules(self) -> list[torch.nn.Module]:
        return [self.text_encoder, self.vae]

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        # right padding under CLIP's causal mask: a prompt's states do not depend on the others'; padding is zeroed
        # ("not a token", as Conditioning.cat pads), so that a cache can trim it
        tokens = self.tokenizer(list(prompts), padding=True, return_tensors="pt").to(self.device)
        mask = tokens.attention_mask
        embeds = self.text_encoder(**tokens).last_hidden_state * mask[..., None]
        return Conditioning({"prompt_embeds": embeds, "prompt_mask": mask.long()},
                            pad_keys=("prompt_embeds", "prompt_mask"))

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        check_size("the toy model", height, width, 8, num_frames)
        return (4, height // 4, width // 4)

    def sigmas(self, num_steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        return shifted_sigmas(self.scheduler, num_steps, (latent_shape[-2] // 2) * (latent_shape[-1] // 2), True)

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, h: int, w: int) -> torch.Tensor:
        mask = cond.tensors["prompt_mask"]
        return self.denoiser(hidden_states=x, timestep=sigma, encoder_hidden_states=cond.tensors["prompt_embeds"],
                             encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                             img_shapes=[[(1, h // 2, w // 2)]] * x.shape[0], return_dict=False)[0].float()

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0,
                 uncond: Conditioning | None = None) -> torch.Tensor:
        h, w = latents.shape[-2:]
        x, sigma = pack_2x2(latents.to(self.device, self.dtype)), sigma.to(self.device)
        v = guided_velocity(lambda c: self._forward(x, sigma, c, h, w), cond, uncond, guidance_scale,
                            forward_pair=lambda c: self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), c, h, w))
        return unpack_2x2(v, h, w)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        images = self.vae.decode(latents.to(self.device), return_dict=False)[0]
        return ((images.float() + 1) / 2).clamp(0, 1).cpu()


class ToyEditModel(ToyFlowModel):
    """``ToyFlowModel`` conditioned on a source image (for engine and algorithm tests of editing): the source, at its
    own size floored to multiples of 8, is encoded by the toy VAE (the posterior's mean), packed into 2x2 tokens that
    follow the noisy ones in the transformer's sequence (its own RoPE frame), and the noisy tokens' output is the
    velocity. Sources of other sizes have other latent grids (``Conditioning.layout``, ``condition_key``)."""

    capabilities = ToyFlowModel.capabilities | {"image-input"}
    condition_images = 1

    @staticmethod
    def _grid(width: int, height: int) -> tuple[int, int]:
        return height // 8, width // 8

    def condition_key(self, request: GenRequest) -> tuple[tuple[int, int], ...] | None:
        from PIL import Image

        if not request.condition_images:
            return None
        with Image.open(request.condition_images[0]) as image:
            return (self._grid(*image.size),)

    @torch.no_grad()
    def encode_with_images(self, prompts: list[str], images: Sequence[Sequence[str]]) -> list[Conditioning]:
        from omnirl_core.data.images import image_tensor, load_image

        text = self.encode(list(prompts))
        rows = []
        for i, paths in enumerate(images):
            row = text.select([i])
            if paths:
                source = load_image(paths[0])
                grid = self._grid(source.width, source.height)
                pixels = image_tensor(paths[0], (grid[0] * 8, grid[1] * 8))[None].to(self.device)
                latents = self.vae.encode(pixels * 2 - 1).latent_dist.mean
                row = Conditioning({**row.tensors, "image_latents": pack_2x2(latents)}, row.pad_keys, layout=(grid,))
            rows.append(row)
        return rows

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, h: int, w: int) -> torch.Tensor:
        tokens = x.shape[1]
        grids = cast("tuple[tuple[int, int], ...]", cond.layout or ())  # the sources' latent grids
        shapes = [(1, h // 2, w // 2), *((1, a, b) for a, b in grids)]
        if "image_latents" in cond.tensors:
            x = torch.cat([x, cond.tensors["image_latents"]], dim=1)
        mask = cond.tensors["prompt_mask"]
        return self.denoiser(hidden_states=x, timestep=sigma, encoder_hidden_states=cond.tensors["prompt_embeds"],
                             encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                             img_shapes=[shapes] * x.shape[0], return_dict=False)[0][:, :tokens].float()
