"""What every diffusers-style flow model plugin shares: LoRA through peft, the frozen reference, and
saving weights in the ecosystem's own layout. A model plugin subclasses ``DenoiserModel`` and writes only
its architecture-specific parts (encode, latent shape, schedule, velocity, decode)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.contracts.data import Conditioning
from omnirl_core.contracts.model import FlowModel
from omnirl_core.lora import adapters_disabled, lora_layers
from omnirl_core.weights import cpu_copy


class DenoiserModel(FlowModel):
    """Base class: ``self.denoiser`` is the trained network, ``self.pipeline`` the diffusers pipeline."""

    default_lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")

    def __init__(self, pipeline: Any, denoiser: torch.nn.Module, device: torch.device, dtype: torch.dtype):
        self.pipeline = pipeline
        self.denoiser = denoiser
        self.device = device
        self.dtype = dtype
        self.lora: LoraConfig | None = None
        self._reference_copy: torch.nn.Module | None = None
        self._in_reference = False

    # -- training setup ------------------------------------------------------------------------
    def setup_training(self, lora: LoraConfig, need_reference: bool) -> None:
        """Freeze everything, then make trainable either a fresh LoRA adapter or the whole denoiser."""
        for module in self.frozen_modules():
            module.requires_grad_(False)
        self.denoiser.requires_grad_(False)
        if lora.enabled:
            from peft import LoraConfig as PeftLoraConfig

            targets = lora.target_modules or list(self.default_lora_targets)
            self.denoiser.add_adapter(  # type: ignore[operator]  # diffusers' ModelMixin, typed as torch's Module
                PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets, init_lora_weights=lora.peft_init)
            )
            self.lora = lora
        else:
            self.denoiser.requires_grad_(True)
            if need_reference:
                self._reference_copy = copy.deepcopy(self.denoiser).requires_grad_(False).eval()
        self.denoiser.train()

    def trained_modules(self) -> dict[str, torch.nn.Module]:
        """The modules training updates, by name (a sharded engine wraps each); one denoiser by default, a
        model with several (Wan2.2 A14B's two experts) names them all."""
        return {"denoiser": self.denoiser}

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.denoiser.parameters() if p.requires_grad]

    def _adapter_layers(self, module: torch.nn.Module) -> list[Any]:
        """``module``'s adapter layers, found once per module (adapters are injected once, at setup)."""
        cache = self.__dict__.setdefault("_adapter_layer_cache", {})
        if id(module) not in cache:
            cache[id(module)] = (module, lora_layers(module))  # the module kept: its id is never reused
        return cache[id(module)][1]

    @contextmanager
    def reference(self) -> Iterator[None]:
        """The frozen reference policy: the base model (LoRA disabled, or a copy made before training)."""
        if self.lora is not None:
            with adapters_disabled(self.denoiser, self._adapter_layers(self.denoiser)):
                yield
        elif self._reference_copy is not None:
            trained, self.denoiser = self.denoiser, self._reference_copy
            try:
                yield
            finally:
                self.denoiser = trained
        else:
            raise RuntimeError("no reference policy: call setup_training(need_reference=True) first")

    # -- weights -------------------------------------------------------------------------------
    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights: the LoRA state (peft names) or the full denoiser state."""
        if self.lora is not None:
            from peft.utils import get_peft_model_state_dict

            return {k: cpu_copy(v) for k, v in get_peft_model_state_dict(self.denoiser).items()}
        return {k: cpu_copy(v) for k, v in self.denoiser.state_dict().items()}

    def load_trained_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.lora is not None:
            from peft.utils import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.denoiser, state)
            unexpected = getattr(result, "unexpected_keys", None)
            if unexpected:
                raise ValueError(f"LoRA state has unexpected keys: {unexpected[:5]}")
        else:
            self.denoiser.load_state_dict(state)

    def save_trained(self, directory: Path, state: dict[str, torch.Tensor] | None = None) -> list[str]:
        """Write the trained weights in the layout diffusers reads back; returns the files written.

        LoRA: ``pytorch_lora_weights.safetensors`` for ``pipeline.load_lora_weights(directory)``.
        Full: ``<denoiser>/`` via ``save_pretrained`` (safetensors), for ``from_pretrained``.
        ``state``: the full trained state to write instead of the module's own (a sharded trainer gathers
        it first, as ``trained_state_dict`` would return it).
        """
        directory.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            from peft.utils import get_peft_model_state_dict

            layers = state if state is not None else get_peft_model_state_dict(self.denoiser)
            type(self.pipeline).save_lora_weights(
                save_directory=str(directory), transformer_lora_layers=layers, safe_serialization=True
            )
            return ["pytorch_lora_weights.safetensors"]
        if state is not None:
            from safetensors.torch import save_file

            (directory / "transformer").mkdir(exist_ok=True)
            self.denoiser.save_config(str(directory / "transformer"))  # type: ignore[operator]  # diffusers'
            save_file(state, str(directory / "transformer" / "diffusion_pytorch_model.safetensors"))
            return ["transformer/"]
        self.denoiser.save_pretrained(  # type: ignore[operator]  # diffusers' ModelMixin
            str(directory / "transformer"), safe_serialization=True)
        return ["transformer/"]

    def load_trained(self, directory: Path) -> None:
        """Load what ``save_trained`` wrote (resume)."""
        from safetensors.torch import load_file

        if self.lora is not None:
            state = load_file(str(directory / "pytorch_lora_weights.safetensors"))
            prefix = "transformer."
            self.load_trained_state_dict({k.removeprefix(prefix): v
                                          for k, v in state.items()})
        else:
            weights = sorted((directory / "transformer").glob("*.safetensors"))
            state = {}
            for file in weights:
                state.update(load_file(str(file)))
            self.load_trained_state_dict(state)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``model.dtype`` names -> torch dtypes."""


def load_diffusers_pipeline(pipeline_cls: Any, path: str, dtype: torch.dtype, label: str, access_note: str = "",
                            **kwargs: object) -> Any:
    """``pipeline_cls.from_pretrained(path)`` for a local diffusers directory or a hub id, with a clear error
    when it is neither (no ``model_index.json`` there, or the hub unreachable / without it). ``label`` names
    the model in messages, ``access_note`` adds how to get the checkpoint (e.g. a gated licence); ``kwargs``
    go to ``from_pretrained`` (e.g. a component set to None)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    from omnirl_core.errors import UsageError

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    local = Path(path).expanduser()
    looks_local = local.exists() or path.startswith((".", "/", "~"))
    if looks_local and not (local / "model_index.json").is_file():
        raise UsageError(
            f"'{path}' is not a diffusers {label} directory (no model_index.json).",
            hint="Point model.path at a directory saved with save_pretrained, or use --preset tiny.",
        )
    try:
        return pipeline_cls.from_pretrained(str(local) if looks_local else path, dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"Could not load {label} from '{path}': it is not a local directory and the hub is unreachable or "
            f"does not have it.{' ' + access_note if access_note else ''}",
            details=[f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"],
            hint="Download the checkpoint to a directory and pass --set model.path=DIR, or use --preset tiny.",
        ) from exc


# -- the model-author kit: what diffusers text-to-image flow models share --------------------------------------

GUIDANCE_MODES = ("cfg", "embedded", "none")
"""How a model uses ``rollout.guidance_scale``: ``cfg`` true classifier-free guidance (a second, unconditional
branch), ``embedded`` guidance distilled into the network (one branch, the scale is an input: FLUX.1-dev),
``none`` no guidance (the scale must be 1: FLUX.1-schnell)."""


def pack_2x2(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) latents -> (B, H/2 * W/2, 4C) tokens of 2x2 patches, the layout of FLUX / Qwen-Image."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of ``pack_2x2`` for a latent grid of ``h`` x ``w``."""
    b, _, ch = x.shape
    x = x.view(b, h // 2, w // 2, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, ch // 4, h, w)


def shifted_sigmas(scheduler: Any, num_steps: int, seq_len: int, linspace: bool = False) -> torch.Tensor:
    """A FlowMatchEuler scheduler's shifted sigmas for ``num_steps`` steps, then 0, fp32: the shift ``mu`` follows
    the image's token count ``seq_len`` when the scheduler shifts dynamically (SD3/FLUX/Qwen-Image's
    ``calculate_shift``). ``linspace``: start from linspace(1, 1/T) as the FLUX and Qwen-Image pipelines pass it,
    instead of the scheduler's own timestep grid (SD3)."""
    import numpy as np

    kwargs: dict[str, Any] = {}
    config = scheduler.config
    if config.get("use_dynamic_shifting", False):
        # SD3 / FLUX / Qwen-Image: mu linear in the token count between (base_seq_len, base_shift) and (max, max)
        base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
        base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
        slope = (max_shift - base_shift) / (max_len - base_len)
        kwargs["mu"] = seq_len * slope + (base_shift - slope * base_len)
    if linspace:
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps), device="cpu", **kwargs)
    else:
        scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
    return torch.as_tensor(np.asarray(scheduler.sigmas), dtype=torch.float32).clone()


CFG_GRAD: ContextVar[str] = ContextVar("omnirl_cfg_grad", default="cond")  # train.cfg_grad, set by the worker


@contextmanager
def cfg_gradient(mode: str) -> Iterator[None]:
    """``train.cfg_grad`` for the training forwards inside: ``cond`` detaches true CFG's unconditional branch,
    ``both`` backpropagates through it too. A model that guides on its own reads ``cfg_grad_both()``."""
    if mode not in ("cond", "both"):
        raise ValueError(f"cfg_grad must be 'cond' or 'both', not {mode!r}")
    token = CFG_GRAD.set(mode)
    try:
        yield
    finally:
        CFG_GRAD.reset(token)


def cfg_grad_both() -> bool:
    """Whether the unconditional branch computed now needs grad (grad enabled and ``train.cfg_grad: both``)."""
    return torch.is_grad_enabled() and CFG_GRAD.get() == "both"


def guided_velocity(forward: Callable[[Conditioning], torch.Tensor], cond: Conditioning,
                    uncond: Conditioning | None, guidance_scale: float, renorm: bool = False,
                    forward_pair: Callable[[Conditioning], torch.Tensor] | None = None) -> torch.Tensor:
    """True classifier-free guidance over ``forward(conditioning) -> v``: v_u + w (v_c - v_u) for w > 1. In
    training the unconditional branch is detached unless ``train.cfg_grad`` is ``both`` (``cfg_gradient``).
    ``renorm`` rescales the guided prediction to the conditional one's norm over the last dim (per token;
    Qwen-Image's true CFG).

    ``forward_pair(conditioning) -> v`` (optional): the same forward over the latents and sigmas repeated twice,
    given the conditional and unconditional conditionings concatenated. Without grad (the rollout, old and
    reference log-probs), and with grad through both branches, they go through one batched call instead of two;
    with the unconditional branch detached it stays a separate no-grad call, so the backward pass never runs
    through it."""
    if guidance_scale <= 1.0:
        return forward(cond)
    if uncond is None:
        raise ValueError("CFG needs the unconditional conditioning")
    both = cfg_grad_both()
    if forward_pair is not None and (both or not torch.is_grad_enabled()):
        v, v_u = forward_pair(Conditioning.cat([cond, uncond])).chunk(2)
    elif both:
        v, v_u = forward(cond), forward(uncond)
    else:
        v = forward(cond)
        with torch.no_grad():
            v_u = forward(uncond)
    combined = v_u + guidance_scale * (v - v_u)
    if renorm:
        combined = combined * (v.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
    return combined


def check_size(label: str, height: int, width: int, multiple: int, num_frames: int | None = None) -> None:
    """An image model's output size: height and width multiples of ``multiple``, no frame count."""
    from omnirl_core.errors import UsageError

    if height % multiple or width % multiple:
        raise UsageError(
            f"{label} needs height and width divisible by {multiple}; got {height}x{width}.",
            hint=f"Set rollout.height/width to multiples of {multiple}.",
        )
    if num_frames not in (None, 1):
        raise UsageError(f"{label} generates images; rollout.num_frames must be unset.")


def check_checkpoint_layout(label: str, path: str, layout: str, found: str, description: str) -> None:
    """A checkpoint of another layout (``found``, ``description`` says what makes it so) than the one
    ``model.options.layout`` names (``layout``) is a usage error that names the right setting."""
    from omnirl_core.errors import UsageError

    if found != layout:
        raise UsageError(
            f"The {label} checkpoint at '{path}' has the {found} ({description}) layout, but model.options.layout is "
            f"'{layout}'.",
            hint=f"Set model.options.layout={found}.",
        )


class DiffusersModelOptions(BaseModel):
    """The options every diffusers flow model plugin has; a plugin's options subclass it and add their own."""

    model_config = ConfigDict(extra="forbid")
    gradient_checkpointing: bool = Field(
        False, description="Recompute each transformer block's activations in the backward pass (less training "
        "memory at high resolution, about a third more compute; same numbers)."
    )
    tiny_seed: int = Field(0, description="Seed of the tiny preset's random weights.")


class DiffusersFlowModel(DenoiserModel):
    """A diffusers text-to-image flow model: the pipeline's transformer is the denoiser; latents are kept as the
    (C, H/s, W/s) grid the core's sampler and shape buckets see. A subclass writes ``encode`` and ``forward`` (one
    transformer call) and sets the class attributes below; the schedule, 2x2 packing, guidance, VAE decoding and
    encoding, gradient checkpointing and size checks come from here.

    ``options`` is the plugin's pydantic options; ``gradient_checkpointing: bool`` there is honoured."""

    label = "model"
    """The name in messages."""
    encodes_images = True
    guidance = "cfg"
    """One of ``GUIDANCE_MODES``; an instance may set its own (a checkpoint with or without a guidance embedding)."""
    cfg_renorm = False
    """With true CFG: rescale the guided prediction to the conditional one's norm per token."""
    packed = False
    """The transformer reads 2x2-patch tokens (``pack_2x2``) rather than the latent grid."""
    patch = 2
    """The transformer's patch size in latent pixels (the output size must be a multiple of vae scale x patch)."""
    linspace_sigmas = False
    """The pipeline passes linspace(1, 1/T) to the scheduler (FLUX, Qwen-Image) rather than a step count (SD3)."""
    video_vae = False
    """The VAE is a video VAE that decodes images as one-frame videos (Qwen-Image's)."""

    def __init__(self, pipeline: Any, options: DiffusersModelOptions, device: torch.device, dtype: torch.dtype):
        super().__init__(pipeline, pipeline.transformer, device, dtype)
        self.options = options
        self.vae_scale = pipeline.vae_scale_factor
        config = pipeline.vae.config
        self.latent_channels = config.get("z_dim") or config.get("latent_channels")

    def setup_training(self, lora: LoraConfig, need_reference: bool) -> None:
        super().setup_training(lora, need_reference)
        if self.options.gradient_checkpointing:
            self.denoiser.enable_gradient_checkpointing()  # type: ignore[operator]  # diffusers' ModelMixin

    def frozen_modules(self) -> list[torch.nn.Module]:
        """Every pipeline component that is a module, but the denoiser (text encoders, VAE)."""
        return [m for m in self.pipeline.components.values()
                if isinstance(m, torch.nn.Module) and m is not self.denoiser]

    # -- the architecture-specific part --------------------------------------------------------------------
    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, grid: tuple[int, int],
                guidance: float | None) -> torch.Tensor:
        """One transformer call, fp32 out: ``x`` in the transformer's layout (``packed`` or the grid) and dtype,
        ``sigma`` (B,) in [0, 1], ``grid`` the latent (H, W), ``guidance`` the scale for ``embedded`` guidance."""
        raise NotImplementedError

    # -- the contract ----------------------------------------------------------------------------------------
    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        check_size(self.label, height, width, self.vae_scale * self.patch, num_frames)
        return (self.latent_channels, height // self.vae_scale, width // self.vae_scale)

    def sigmas(self, num_steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """The pipeline's schedule (``shifted_sigmas``) for this image size."""
        seq_len = (latent_shape[-2] // self.patch) * (latent_shape[-1] // self.patch)
        return shifted_sigmas(self.pipeline.scheduler, num_steps, seq_len, self.linspace_sigmas)

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0,
                 uncond: Conditioning | None = None) -> torch.Tensor:
        """``forward`` under the model's guidance: true CFG (two branches), embedded (the scale as an input; an
        unconditional conditioning is not used) or none."""
        h, w = latents.shape[-2:]
        x = latents.to(self.device, self.dtype)
        if self.packed:
            x = pack_2x2(x)
        sigma = sigma.to(self.device)
        if self.guidance == "embedded":
            v = self.forward(x, sigma, cond, (h, w), guidance_scale)
        elif self.guidance == "none" and guidance_scale != 1.0:
            from omnirl_core.errors import UsageError

            raise UsageError(f"{self.label} has no guidance; got guidance scale {guidance_scale:g}.",
                             hint="Set rollout.guidance_scale=1.")
        else:
            v = guided_velocity(lambda c: self.forward(x, sigma, c, (h, w), None), cond, uncond, guidance_scale,
                                self.cfg_renorm, lambda c: self.forward(x.repeat(2, *[1] * (x.dim() - 1)),
                                                                        sigma.repeat(2), c, (h, w), None))
        return unpack_2x2(v, h, w) if self.packed else v

    def _channel_stats(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-channel ``latents_mean`` / ``latents_std`` shaped for ``z`` (Wan-style VAEs), or None (SD3/FLUX-style
        VAEs normalise with a scalar shift and scaling factor)."""
        config = self.pipeline.vae.config
        if config.get("latents_mean") is None:
            return None
        shape = (1, -1) + (1,) * (z.dim() - 2)
        return (torch.tensor(config.latents_mean, device=z.device, dtype=z.dtype).view(shape),
                torch.tensor(config.latents_std, device=z.device, dtype=z.dtype).view(shape))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> images (B, 3, H, W) in [0, 1] (videos (B, 3, F, H, W) for 5-D latents), the pipeline's own
        denormalisation."""
        vae = self.pipeline.vae
        z = latents.to(self.device, vae.dtype)
        if self.video_vae and z.dim() == 4:
            z = z.unsqueeze(2)
        stats = self._channel_stats(z)
        if stats is not None:
            z = z * stats[1] + stats[0]
        else:
            z = z / vae.config.scaling_factor + (vae.config.get("shift_factor") or 0.0)
        out = vae.decode(z, return_dict=False)[0]
        if self.video_vae and latents.dim() == 4:
            out = out[:, :, 0]
        return ((out.float() + 1) / 2).clamp(0, 1).cpu()

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] -> latents of ``latent_shape``, the inverse of ``decode``: the VAE
        posterior's mean (deterministic), normalised as the pipeline does, fp32."""
        vae = self.pipeline.vae
        x = images.to(self.device, vae.dtype) * 2 - 1
        if self.video_vae:
            x = x.unsqueeze(2)
        z = vae.encode(x).latent_dist.mean
        stats = self._channel_stats(z)
        if stats is not None:
            z = (z - stats[0]) / stats[1]
        else:
            z = (z - (vae.config.get("shift_factor") or 0.0)) * vae.config.scaling_factor
        return (z[:, :, 0] if self.video_vae else z).float()


def tiny_directory(name: str, version: int, seed: int, build: Callable[[int], Any]) -> Path:
    """The on-disk cache of a tiny preset: ``build(seed)`` returns a diffusers pipeline with random weights, saved
    once (atomically) in the diffusers layout under ``<cache>/presets/<name>-tiny-v<version>-seed<seed>`` so that
    it loads through ``from_pretrained`` like a released checkpoint. Bump ``version`` when the architecture
    changes."""
    from omnirl_core.presets import atomic_directory, cache_dir

    target = cache_dir() / "presets" / f"{name}-tiny-v{version}-seed{seed}"
    return atomic_directory(target, lambda tmp: save_pipeline(build(seed), tmp))


def save_pipeline(pipeline: Any, directory: str | Path) -> Path:
    """Save a pipeline in the diffusers layout (``model_index.json`` + components, safetensors)."""
    directory = Path(directory)
    pipeline.save_pretrained(str(directory), safe_serialization=True)
    return directory


def create_flow_model(model_cls: Callable[..., FlowModel], pipeline_cls: Any, section: ModelSection,
                      options: DiffusersModelOptions, device: torch.device | str, *, label: str,
                      tiny: tuple[str, int, Callable[[int], Any]], default: str,
                      presets: dict[str, str] | None = None, access_note: str = "",
                      check: Callable[[Any, str], None] | None = None,
                      **load_kwargs: object) -> FlowModel:
    """The usual model factory: the checkpoint directory (the ``tiny`` preset, ``tiny = (name, version,
    build(seed))`` cached by ``tiny_directory`` with seed ``options.tiny_seed``; ``model.path``; a named preset's
    hub id from ``presets``; else ``default``), ``pipeline_cls.from_pretrained`` with clear errors,
    ``check(pipeline, path)`` (raise on a mismatch with the options), then the pipeline on the device wrapped in
    ``model_cls(pipeline, options, device, dtype)``."""
    from omnirl_core.presets import checkpoint_path

    dtype_name: str = section.dtype
    if dtype_name == "auto":  # resolution makes it concrete; a plugin's own tests may call the factory directly
        from omnirl_core.precision import concrete_dtype

        dtype_name = concrete_dtype(dtype_name, torch.device(device).type)
    dtype = DTYPES[dtype_name]
    name, version, build = tiny
    path = checkpoint_path(section, section.name or label,
                           lambda: tiny_directory(name, version, options.tiny_seed, build), default,
                           presets)
    pipeline = load_diffusers_pipeline(pipeline_cls, path, dtype, label, access_note, **load_kwargs)
    if check is not None:
        check(pipeline, path)
    pipeline = pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    return model_cls(pipeline, options, torch.device(device), dtype)
