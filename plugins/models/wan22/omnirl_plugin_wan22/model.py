"""Wan2.2 text-to-video behind the omnirl flow-model contract, on diffusers' WanPipeline components.

Latents are (C, T, H, W) per sample; the core sampler treats them like image latents (the log-probs
average over every element). Two layouts:

- ``a14b``: two expert transformers. ``transformer`` denoises the high-noise part of the trajectory
  (sigma >= boundary_ratio), ``transformer_2`` the low-noise part, exactly as WanPipeline switches them.
  ``velocity`` routes every sample of a batch to its expert by its own sigma, so a training micro-batch
  that mixes denoising steps still sees the weights that generated each transition. ``train_experts``
  says which experts get a LoRA adapter (or are fine-tuned); an untrained expert stays frozen.
- ``ti2v-5b``: one transformer, the 48-channel VAE, and per-token timesteps (``expand_timesteps``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.contracts import Conditioning
from omnirl_core.errors import UsageError
from omnirl_core.flow.model import (
    DenoiserModel,
    DiffusersModelOptions,
    check_checkpoint_layout,
    create_flow_model,
    guided_velocity,
    load_diffusers_pipeline,
)
from omnirl_core.lora import adapters_disabled
from omnirl_core.weights import cpu_copy

HUB_IDS = {"a14b": "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "ti2v-5b": "Wan-AI/Wan2.2-TI2V-5B-Diffusers"}
HIGH, LOW = "transformer", "transformer_2"
# diffusers' LoRA file of each expert; the low-noise one loads with load_lora_weights(...,
# weight_name=LORA_FILES[LOW], load_into_transformer_2=True)
LORA_FILES = {HIGH: "pytorch_lora_weights.safetensors", LOW: "pytorch_lora_weights_transformer_2.safetensors"}


class Wan22Options(DiffusersModelOptions):
    """With the common ones (``gradient_checkpointing``: recompute each transformer block in the backward pass,
    much less training memory for long videos; ``tiny_seed``)."""

    layout: Literal["a14b", "ti2v-5b"] = Field(
        "a14b", description="a14b: two experts switched at a boundary sigma (T2V-A14B); ti2v-5b: one "
        "transformer and the 48-channel VAE (TI2V-5B). Picks the default checkpoint and the tiny architecture."
    )
    train_experts: Literal["both", "high", "low"] = Field(
        "both", description="a14b: which experts are trained (high = transformer, sigma >= boundary; low = "
        "transformer_2). The other stays frozen. ti2v-5b has one transformer and ignores this."
    )
    boundary_ratio: float | None = Field(
        None, gt=0, lt=1, description="a14b: sigma at which the low-noise expert takes over; None: the "
        "checkpoint's value (0.875 for T2V-A14B)."
    )
    guidance_scale_2: float | None = Field(
        None, ge=1, description="a14b: CFG scale of the low-noise expert when CFG is on; None: "
        "rollout.guidance_scale for both experts."
    )
    max_sequence_length: int = Field(
        512, ge=1, le=1024, description="Prompt tokens; UMT5 embeddings are zero-padded to this length as "
        "WanPipeline does (the transformer attends to the padding too)."
    )


class Wan22Model(DenoiserModel):
    capabilities = frozenset({"flow-matching", "sde-logprob", "cfg", "lora", "video"})
    # self-attention, cross-attention to the prompt, and the feed-forward of every block
    default_lora_targets = (
        "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
        "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
        "ffn.net.0.proj", "ffn.net.2",
    )

    def __init__(self, pipeline: Any, options: Wan22Options, device: torch.device, dtype: torch.dtype):
        self.experts: dict[str, torch.nn.Module] = {HIGH: pipeline.transformer}
        boundary = options.boundary_ratio or pipeline.config.boundary_ratio
        if pipeline.transformer_2 is not None:
            self.experts[LOW] = pipeline.transformer_2
            if boundary is None:
                raise UsageError(
                    "This Wan2.2 checkpoint has two transformers but no boundary_ratio in model_index.json.",
                    hint="Set model.options.boundary_ratio (0.875 for T2V-A14B).",
                )
        self.boundary = boundary if len(self.experts) > 1 else None
        which = {"both": (HIGH, LOW), "high": (HIGH,), "low": (LOW,)}[options.train_experts]
        # the experts trained: those named by train_experts (a14b), or the one transformer (ti2v-5b)
        self.trained = tuple(name for name in which if name in self.experts) if self.boundary else (HIGH,)
        super().__init__(pipeline, self.experts[self.trained[0]], device, dtype)
        self.options = options
        self.expand_timesteps = bool(pipeline.config.expand_timesteps)
        self.num_train_timesteps = pipeline.scheduler.config.num_train_timesteps
        self.scale_spatial = pipeline.vae_scale_factor_spatial
        self.scale_temporal = pipeline.vae_scale_factor_temporal
        self.z_dim = pipeline.vae.config.z_dim
        self.patch = tuple(pipeline.transformer.config.patch_size)
        self._reference_copies: dict[str, torch.nn.Module] = {}

    @property
    def denoiser(self) -> torch.nn.Module:
        """The trained expert, for code that trains one module. With both A14B experts trained there is no
        single one: refused rather than training half the policy (engines use ``trained_modules``)."""
        if len(self.trained) > 1:
            raise UsageError(
                "Wan2.2 A14B trains both experts here, but this code works on one module (model.denoiser), "
                "so it would leave the low-noise expert untrained.",
                hint="Use a train engine that reads model.trained_modules() (torch, fsdp2), or set "
                     "model.options.train_experts=high or low.",
            )
        return self.experts[self.trained[0]]

    def trained_modules(self) -> dict[str, torch.nn.Module]:
        """Every trained expert by component name (``transformer``, ``transformer_2``): fsdp2 shards each."""
        return {name: self.experts[name] for name in self.trained}

    @denoiser.setter
    def denoiser(self, module: torch.nn.Module) -> None:
        """The base class assigns it; ``experts`` holds the modules here."""

    def frozen_modules(self) -> list[torch.nn.Module]:
        return [self.pipeline.text_encoder, self.pipeline.vae,
                *(m for name, m in self.experts.items() if name not in self.trained)]

    # -- training setup: the base class's, over every trained expert ----------------------------
    def setup_training(self, lora: LoraConfig, need_reference: bool) -> None:
        for module in (*self.frozen_modules(), *self.experts.values()):
            module.requires_grad_(False)
        if lora.enabled:
            from peft import LoraConfig as PeftLoraConfig

            targets = lora.target_modules or list(self.default_lora_targets)
            for name in self.trained:
                self.experts[name].add_adapter(PeftLoraConfig(
                    r=lora.rank, lora_alpha=lora.alpha, target_modules=targets, init_lora_weights=lora.peft_init))
            self.lora = lora
        else:
            for name in self.trained:
                self.experts[name].requires_grad_(True)
                if need_reference:
                    self._reference_copies[name] = copy.deepcopy(self.experts[name]).requires_grad_(False).eval()
        for name in self.trained:
            self.experts[name].train()
            if self.options.gradient_checkpointing:
                self.experts[name].enable_gradient_checkpointing()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for name in self.trained for p in self.experts[name].parameters() if p.requires_grad]

    @contextmanager
    def reference(self) -> Iterator[None]:
        if self.lora is not None:
            with contextlib.ExitStack() as stack:
                for name in self.trained:
                    expert = self.experts[name]
                    stack.enter_context(adapters_disabled(expert, self._adapter_layers(expert)))
                yield
        elif self._reference_copies:
            trained = dict(self.experts)
            self.experts.update(self._reference_copies)
            try:
                yield
            finally:
                self.experts.update(trained)
        else:
            raise RuntimeError("no reference policy: call setup_training(need_reference=True) first")

    # -- contract ------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        embeds = self.pipeline._get_t5_prompt_embeds(
            list(prompts), max_sequence_length=self.options.max_sequence_length, device=self.device, dtype=self.dtype
        )
        return Conditioning({"prompt_embeds": embeds})

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        if num_frames is None or (num_frames - 1) % self.scale_temporal:
            raise UsageError(
                f"Wan2.2 generates videos of {self.scale_temporal}k+1 frames; got rollout.num_frames={num_frames}.",
                hint=f"Set rollout.num_frames to e.g. {4 * self.scale_temporal + 1} (81 for released checkpoints).",
            )
        multiple = self.scale_spatial * self.patch[-1]
        if height % multiple or width % multiple:
            raise UsageError(
                f"Wan2.2 ({self.options.layout}) needs height and width divisible by {multiple}; got "
                f"{height}x{width}.",
                hint=f"Set rollout.height/width to multiples of {multiple}.",
            )
        frames = (num_frames - 1) // self.scale_temporal + 1
        return (self.z_dim, frames, height // self.scale_spatial, width // self.scale_spatial)

    def sigmas(self, num_steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """The checkpoint scheduler's shifted flow sigmas, then 0. UniPC nudges the first sigma to 1 - 1e-6
        for its own log(alpha); the core sampler handles sigma = 1 itself, so it is kept at exactly 1."""
        scheduler = self.pipeline.scheduler
        scheduler.set_timesteps(num_steps, device="cpu")
        sigmas = torch.as_tensor(scheduler.sigmas, dtype=torch.float32).clone()
        if abs(float(sigmas[0]) - 1.0) < 1e-5:
            sigmas[0] = 1.0
        return sigmas

    def _route(self, sigma: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(expert, sample indices) for the experts that denoise some sample of this batch."""
        if self.boundary is None:
            return [(HIGH, torch.arange(sigma.shape[0], device=sigma.device))]
        # WanPipeline's rule: t >= boundary_ratio * num_train_timesteps -> high-noise expert
        high = sigma * self.num_train_timesteps >= self.boundary * self.num_train_timesteps
        routes = [(HIGH, high.nonzero().flatten()), (LOW, (~high).nonzero().flatten())]
        return [(name, idx) for name, idx in routes if idx.numel()]

    def _forward(self, expert: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor,
                 cond: Conditioning) -> torch.Tensor:
        t = sigma.float() * self.num_train_timesteps
        if self.expand_timesteps:  # TI2V-5B: one timestep per latent token (all equal for text-to-video)
            tokens = (x.shape[2] // self.patch[0]) * (x.shape[3] // self.patch[1]) * (x.shape[4] // self.patch[2])
            t = t[:, None].expand(-1, tokens)
        out = expert(
            hidden_states=x,
            timestep=t,
            encoder_hidden_states=cond.tensors["prompt_embeds"].to(self.dtype),
            return_dict=False,
        )[0]
        return out.float()

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0,
                 uncond: Conditioning | None = None) -> torch.Tensor:
        x = latents.to(self.device, self.dtype)
        sigma = sigma.to(self.device)
        if guidance_scale > 1.0 and uncond is None:
            raise ValueError("CFG needs the unconditional conditioning")
        parts, order = [], []
        routes = dict(self._route(sigma))
        idle = 0.0
        for name in self.experts:  # a fixed order: high-noise, then low-noise
            idx = routes.get(name)
            if idx is None:
                if self.lockstep and name in self.trained:
                    # a sharded engine's ranks must make the same collective calls: this rank has no sample
                    # for the expert, so it runs it on one row and adds the result times 0
                    idle = idle + 0.0 * self._expert_velocity(name, x[:1], sigma[:1], cond.select([0]),
                                                              None if uncond is None else uncond.select([0]),
                                                              guidance_scale).sum()
                continue
            whole = idx.numel() == x.shape[0]
            pick = idx.tolist()
            parts.append(self._expert_velocity(
                name, x if whole else x[idx], sigma if whole else sigma[idx], cond if whole else cond.select(pick),
                None if uncond is None else (uncond if whole else uncond.select(pick)), guidance_scale))
            order.append(idx)
        if len(parts) == 1:
            return parts[0] + idle if self.lockstep else parts[0]
        # back to the batch order (differentiable: a gather, no in-place writes)
        inverse = torch.argsort(torch.cat(order))
        return torch.cat(parts)[inverse]

    def _expert_velocity(self, name: str, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning,
                         uncond: Conditioning | None, guidance_scale: float) -> torch.Tensor:
        scale = guidance_scale
        if guidance_scale > 1.0 and name == LOW and self.options.guidance_scale_2 is not None:
            scale = self.options.guidance_scale_2
        expert = self.experts[name]
        return guided_velocity(lambda c: self._forward(expert, x, sigma, c), cond, uncond, scale,
                               forward_pair=lambda c: self._forward(expert, torch.cat([x, x]), torch.cat([sigma, sigma]),
                                                                    c))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        z = latents.to(self.device, vae.dtype)
        shape = (1, self.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(shape)
        std = torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(shape)
        video = vae.decode(z * std + mean, return_dict=False)[0]  # (B, 3, F, H, W) in [-1, 1]
        return ((video.float() + 1) / 2).clamp(0, 1).cpu()

    # -- weights: per expert, in the files diffusers' WanPipeline reads ---------------------------
    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights of every trained expert, keys prefixed by the expert's component name."""
        from peft.utils import get_peft_model_state_dict

        out = {}
        for name in self.trained:
            expert = self.experts[name]
            state = get_peft_model_state_dict(expert) if self.lora is not None else expert.state_dict()
            out.update({f"{name}.{k}": cpu_copy(v) for k, v in state.items()})
        return out

    def load_trained_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from peft.utils import set_peft_model_state_dict

        for name in self.trained:
            prefix = f"{name}."
            part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            if self.lora is not None:
                result = set_peft_model_state_dict(self.experts[name], part)
                unexpected = getattr(result, "unexpected_keys", None)
                if unexpected:
                    raise ValueError(f"LoRA state of {name} has unexpected keys: {unexpected[:5]}")
            else:
                self.experts[name].load_state_dict(part)

    def save_trained(self, directory: Path, state: dict[str, torch.Tensor] | None = None) -> list[str]:
        """LoRA: ``pytorch_lora_weights.safetensors`` (high-noise expert, ``pipe.load_lora_weights(dir)``)
        and ``pytorch_lora_weights_transformer_2.safetensors`` (low-noise expert, ``pipe.load_lora_weights(
        dir, weight_name=..., load_into_transformer_2=True)``). Full: ``transformer/``, ``transformer_2/``
        for ``WanTransformer3DModel.from_pretrained``. ``state``: as ``trained_state_dict`` returns it (a
        sharded trainer gathers it first); None takes the modules' own."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        state = self.trained_state_dict() if state is None else state
        files = []
        for name in self.trained:
            prefix = f"{name}."
            part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            if self.lora is not None:
                type(self.pipeline).save_lora_weights(
                    save_directory=str(directory), transformer_lora_layers=part, weight_name=LORA_FILES[name],
                    safe_serialization=True,
                )
                files.append(LORA_FILES[name])
            else:
                (directory / name).mkdir(exist_ok=True)
                self.experts[name].save_config(str(directory / name))
                save_file(part, str(directory / name / "diffusion_pytorch_model.safetensors"))
                files.append(f"{name}/")
        return files

    def load_trained(self, directory: Path) -> None:
        from safetensors.torch import load_file

        state = {}
        for name in self.trained:
            if self.lora is not None:
                # diffusers prefixes every key with "transformer." whichever expert the file is for
                loaded = load_file(str(directory / LORA_FILES[name]))
                state.update({f"{name}.{k.removeprefix('transformer.')}": v for k, v in loaded.items()})
            else:
                for file in sorted((directory / name).glob("*.safetensors")):
                    state.update({f"{name}.{k}": v for k, v in load_file(str(file)).items()})
        self.load_trained_state_dict(state)


def load_pipeline(path: str, dtype: torch.dtype):
    """``WanPipeline.from_pretrained`` on a local directory or a hub id, with a clear error."""
    from diffusers import WanPipeline

    return load_diffusers_pipeline(WanPipeline, path, dtype, "Wan2.2")


def check_layout(pipeline: Any, layout: str, path: str) -> None:
    """The checkpoint must have the layout the options name (two experts for a14b, one for ti2v-5b)."""
    if pipeline.transformer_2 is not None:
        check_checkpoint_layout("Wan2.2", path, layout, "a14b", "two expert transformers")
    else:
        check_checkpoint_layout("Wan2.2", path, layout, "ti2v-5b", "one transformer")


def create_model(section: ModelSection, options: Wan22Options | None, device: Any) -> Wan22Model:
    from diffusers import WanPipeline

    from omnirl_plugin_wan22.tiny import TINY_VERSION, build_tiny_pipeline

    options = options or Wan22Options()
    return create_flow_model(
        Wan22Model, WanPipeline, section, options, device, label="Wan2.2", default=HUB_IDS[options.layout],
        tiny=(f"wan2.2-{options.layout}", TINY_VERSION, functools.partial(build_tiny_pipeline, options.layout)),
        check=lambda pipeline, path: check_layout(pipeline, options.layout, path),
    )
