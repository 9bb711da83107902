"""BAGEL behind the omnirl flow-model contract.

Latents are kept unpatchified, (16, H/8, W/8) per sample, so that the core's sampler and shape buckets see the
latent grid; ``velocity`` turns them into BAGEL's 2x2 latent tokens (64 channels in (p, q, c) order), runs the
image block through the MoT language model after the prompt, and turns the velocity back.

Conditioning is the prompt's token ids ([<|im_start|>] + text + [<|im_end|>], no chat template) and, while the
text side of the model is frozen, the prompt's keys and values in every layer (``prompt_kv``): text attends
only to earlier text, so they do not depend on the image, and every denoising step of every sample of the prompt
reuses them (rollout and training recompute alike). A blank prompt (empty or whitespace, the core's default
negative prompt) is BAGEL's text-dropped context: no tokens, the image block at RoPE position 0.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.contracts import Conditioning
from omnirl_core.errors import UsageError
from omnirl_core.flow.model import DTYPES, DenoiserModel, cfg_grad_both
from omnirl_core.lora import adapters_disabled
from omnirl_core.presets import atomic_directory, cache_dir, checkpoint_path
from omnirl_plugin_bagel.checkpoint import load_autoencoder, load_tokenizer, load_transformer, save_checkpoint
from omnirl_plugin_bagel.transformer import BagelTransformer

DEFAULT_HUB_ID = "ByteDance-Seed/BAGEL-7B-MoT"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FULL_WEIGHTS_DIR = "model"
HEADS = ("time_embedder.", "vae2llm.", "llm2vae.", "latent_pos_embed.")

LORA_TARGETS = {
    "gen": ("self_attn.q_proj_moe_gen", "self_attn.k_proj_moe_gen", "self_attn.v_proj_moe_gen",
            "self_attn.o_proj_moe_gen", "mlp_moe_gen.gate_proj", "mlp_moe_gen.up_proj", "mlp_moe_gen.down_proj"),
    "und": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj"),
}
LORA_TARGETS["both"] = LORA_TARGETS["gen"] + LORA_TARGETS["und"]


class BagelOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timestep_shift: float = Field(
        3.0, gt=0, description="Shift s of the schedule t = s u / (1 + (s - 1) u), u = linspace(1, 0): BAGEL's "
        "inference value is 3.0."
    )
    cfg_renorm: Literal["global", "channel", "none"] = Field(
        "global", description="Rescaling of the text-CFG velocity: 'global' by |v_cond| / |v_cfg| over the whole "
        "sample, 'channel' per latent token (BAGEL's text_channel, image CFG being off), clamped to "
        "[cfg_renorm_min, 1]; 'none' keeps v_cfg."
    )
    cfg_renorm_min: float = Field(0.0, ge=0, le=1, description="Lower clamp of the renorm factor (1.0 turns renorm off).")
    cfg_interval: tuple[float, float] = Field(
        (0.0, 1.0), description="CFG applies at flow times lo < t <= hi; elsewhere the conditional velocity is used. "
        "BAGEL's text-to-image demo uses (0.4, 1.0); the RL ports (flow_grpo, verl-omni) (0.0, 1.0)."
    )
    max_prompt_tokens: int = Field(256, ge=1, description="Prompt text tokens kept (the markers not counted).")
    prompt_kv_cache: bool = Field(
        True, description="Keep each prompt's keys and values in every layer with its conditioning, so that "
        "denoising runs the image block only. Used only while the text side is frozen (train_expert 'gen')."
    )
    train_expert: Literal["gen", "und", "both"] = Field(
        "gen", description="The MoT expert(s) training adapts: the generation expert (what BAGEL's RL ports train), "
        "the understanding expert, or both. Picks the default LoRA targets (model.lora.target_modules overrides) "
        "and, in full fine-tuning, which layer weights train. The generation heads stay frozen."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each decoder layer's activations in the backward pass (less training "
        "memory, about a third more compute; same numbers)."
    )
    tiny_seed: int = Field(0, description="Seed of the tiny preset's random weights.")

    @model_validator(mode="after")
    def _interval(self) -> BagelOptions:
        lo, hi = self.cfg_interval
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"cfg_interval must satisfy 0 <= lo < hi <= 1, got {self.cfg_interval}")
        return self


def patchify(latents: torch.Tensor, p: int = 2) -> torch.Tensor:
    """(B, C, p h, p w) -> (B, h w, p p C): tokens row-major over (h, w), each ordered (p, q, c)."""
    b, c, hh, ww = latents.shape
    x = latents.view(b, c, hh // p, p, ww // p, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (hh // p) * (ww // p), p * p * c)


def unpatchify(tokens: torch.Tensor, h: int, w: int, p: int = 2) -> torch.Tensor:
    """The inverse of ``patchify``: (B, h w, p p C) -> (B, C, p h, p w)."""
    b, _, ch = tokens.shape
    c = ch // (p * p)
    return tokens.view(b, h, w, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h * p, w * p)


def is_generation_only(name: str) -> bool:
    """Parameters that only latent tokens read: the generation expert and the generation heads."""
    return "_moe_gen" in name or name.startswith(HEADS)


class BagelModel(DenoiserModel):
    capabilities = frozenset({"flow-matching", "sde-logprob", "cfg", "lora", "image"})
    encodes_images = True
    default_lora_targets = LORA_TARGETS["gen"]

    def __init__(self, transformer: BagelTransformer, vae: Any, tokenizer: Any, special_ids: dict[str, int],
                 options: BagelOptions, device: torch.device, dtype: torch.dtype, report: Any = None):
        super().__init__(None, transformer, device, dtype)
        self.vae = vae
        self.tokenizer = tokenizer
        self.special_ids = special_ids
        self.options = options
        self.config = transformer.config
        self.load_report = report
        self.negative_prompt = ""
        self.text_trainable = False
        self._peft_config: Any = None

    # -- training setup ------------------------------------------------------------------------
    def lora_target_names(self, patterns: Sequence[str] | None) -> list[str]:
        """Full names of the linear modules to adapt: ``patterns`` (regexes matched against the whole name, or
        name suffixes) or the default targets of ``train_expert``."""
        patterns = list(patterns or LORA_TARGETS[self.options.train_expert])
        regexes = [re.compile(p) for p in patterns]
        names = [name for name, module in self.denoiser.named_modules() if isinstance(module, torch.nn.Linear)
                 and any(r.fullmatch(name) or name.endswith("." + r.pattern) for r in regexes)]
        if not names:
            raise UsageError(f"No linear module of BAGEL matches the LoRA targets {patterns}.",
                             hint="Use names such as 'self_attn.q_proj_moe_gen' or 'mlp_moe_gen.up_proj' (the "
                             "generation expert), 'self_attn.q_proj' (understanding), or leave "
                             "model.lora.target_modules unset.")
        return names

    def setup_training(self, lora: LoraConfig, need_reference: bool) -> None:
        """Freeze everything, then make trainable a LoRA adapter on the chosen expert or that expert's weights."""
        self.vae.requires_grad_(False)
        self.denoiser.requires_grad_(False)
        if lora.enabled:
            from peft import LoraConfig as PeftLoraConfig
            from peft import inject_adapter_in_model

            self._peft_config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, init_lora_weights=True,
                                               target_modules=self.lora_target_names(lora.target_modules))
            inject_adapter_in_model(self._peft_config, self.denoiser, adapter_name="default")
            self.lora = lora
        else:
            expert = self.options.train_expert
            for name, p in self.denoiser.named_parameters():
                in_llm = name.startswith("language_model.")
                gen = "_moe_gen" in name
                p.requires_grad_(in_llm and (expert == "both" or (expert == "gen") == gen))
            if need_reference:
                self._reference_copy = copy.deepcopy(self.denoiser).requires_grad_(False)
        self.denoiser.gradient_checkpointing = self.options.gradient_checkpointing
        self.text_trainable = any(p.requires_grad and not is_generation_only(n)
                                  for n, p in self.denoiser.named_parameters())

    def frozen_modules(self) -> list[torch.nn.Module]:
        return [self.vae]

    @contextmanager
    def reference(self) -> Iterator[None]:
        if self.lora is None:
            with super().reference():
                yield
            return
        with adapters_disabled(self.denoiser):
            yield

    # -- contract ------------------------------------------------------------------------------
    @property
    def caches_prompt_kv(self) -> bool:
        return self.options.prompt_kv_cache and not self.text_trainable

    def prompt_ids(self, prompt: str) -> list[int]:
        """[<|im_start|>] + text tokens + [<|im_end|>]; nothing for a blank prompt (the text-dropped context)."""
        if not prompt.strip():
            return []
        text = self.tokenizer.encode(prompt, add_special_tokens=False)[: self.options.max_prompt_tokens]
        return [self.special_ids["<|im_start|>"], *text, self.special_ids["<|im_end|>"]]

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        rows = [self.prompt_ids(p) for p in prompts]
        # at least one position: the text-dropped context is one padding slot (mask 0), so that every
        # conditioning row has a sequence dimension to pad and trim
        width = max(1, *(len(r) for r in rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        tensors = {"input_ids": ids.to(self.device), "text_mask": mask.to(self.device)}
        if self.caches_prompt_kv:
            tensors["prompt_kv"] = self.denoiser.prompt_kv(tensors["input_ids"], tensors["text_mask"])
        return Conditioning(tensors, pad_keys=tuple(tensors))

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        step = self.config.pixels_per_token
        if height % step or width % step:
            raise UsageError(f"BAGEL needs height and width divisible by {step}; got {height}x{width}.",
                             hint=f"Set rollout.height/width to multiples of {step}.")
        limit = self.config.max_latent_size * step
        if height > limit or width > limit:
            raise UsageError(f"BAGEL generates at most {limit}x{limit} pixels (max_latent_size "
                             f"{self.config.max_latent_size} tokens of {step} px); got {height}x{width}.",
                             hint=f"Set rollout.height/width to at most {limit}.")
        if num_frames not in (None, 1):
            raise UsageError("BAGEL generates images; rollout.num_frames must be unset.")
        down = self.config.vae_downsample
        return (self.config.vae_z_channels, height // down, width // down)

    def sigmas(self, num_steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """BAGEL's schedule: u = linspace(1, 0, num_steps + 1), t = s u / (1 + (s - 1) u), s = timestep_shift;
        the first t is exactly 1 and the last 0."""
        u = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
        s = self.options.timestep_shift
        return (s * u / (1 + (s - 1) * u)).to(torch.float32)

    def _branch(self, tokens: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, h: int, w: int) -> torch.Tensor:
        t = cond.tensors
        kv = t.get("prompt_kv") if self.caches_prompt_kv else None
        return self.denoiser(tokens, sigma.to(self.device, torch.float32), h, w, t["input_ids"].to(self.device),
                             t["text_mask"].to(self.device), self.special_ids["<|vision_start|>"],
                             self.special_ids["<|vision_end|>"], None if kv is None else kv.to(self.device))

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0,
                 uncond: Conditioning | None = None) -> torch.Tensor:
        p = self.config.latent_patch_size
        h, w = latents.shape[-2] // p, latents.shape[-1] // p
        tokens = patchify(latents.to(self.device, self.dtype), p)
        v = self._branch(tokens, sigma, cond, h, w)
        if guidance_scale > 1.0:
            if uncond is None:
                raise ValueError("CFG needs the unconditional (text-dropped) conditioning")
            with nullcontext() if cfg_grad_both() else torch.no_grad():  # detached in training unless
                v_uncond = self._branch(tokens, sigma, uncond, h, w)        # train.cfg_grad is both
            v = self.guide(v, v_uncond, guidance_scale, sigma.to(self.device))
        return unpatchify(v, h, w, p)

    def guide(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float, sigma: torch.Tensor) -> torch.Tensor:
        """BAGEL's text CFG on (B, tokens, 64) velocities: v = v_u + s (v_c - v_u), renormalised to at most the
        conditional velocity's norm (``cfg_renorm``), inside ``cfg_interval`` only."""
        v = v_uncond + scale * (v_cond - v_uncond)
        o = self.options
        if o.cfg_renorm != "none":
            dims = (1, 2) if o.cfg_renorm == "global" else (2,)
            factor = v_cond.norm(dim=dims, keepdim=True) / (v.norm(dim=dims, keepdim=True) + 1e-8)
            v = v * factor.clamp(min=o.cfg_renorm_min, max=1.0)
        lo, hi = o.cfg_interval
        inside = ((sigma > lo) & (sigma <= hi)).view(-1, 1, 1)
        return torch.where(inside, v, v_cond)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        images = self.vae.decode(latents.to(self.device, self.dtype))
        return (images.float() * 0.5 + 0.5).clamp(0, 1).cpu()

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] -> latents (B, 16, H/8, W/8): the posterior's mean, normalised, fp32."""
        return self.vae.encode(images.to(self.device, self.dtype) * 2 - 1).float()

    # -- weights -------------------------------------------------------------------------------
    def save_trained(self, directory: Path, state: dict[str, torch.Tensor] | None = None) -> list[str]:
        """LoRA: peft's adapter layout (``adapter_model.safetensors`` + ``adapter_config.json``), which
        ``PeftModel.from_pretrained(transformer, directory)`` reads. Full: ``model/`` in the released layout
        (configuration files + ``ema.safetensors`` of the trained network, released names)."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        state = state if state is not None else self.trained_state_dict()
        if self.lora is not None:
            save_file({f"base_model.model.{k}": v.contiguous() for k, v in state.items()},
                      str(directory / ADAPTER_WEIGHTS))
            config = self._peft_config.to_dict()
            config["base_model_name_or_path"] = None
            (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, default=sorted))
            return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
        save_checkpoint(directory / FULL_WEIGHTS_DIR, self.config, state)
        return [f"{FULL_WEIGHTS_DIR}/"]

    def load_trained(self, directory: Path) -> None:
        from safetensors.torch import load_file

        if self.lora is not None:
            state = load_file(str(directory / ADAPTER_WEIGHTS))
            self.load_trained_state_dict({k.removeprefix("base_model.model."): v for k, v in state.items()})
        else:
            self.load_trained_state_dict(load_file(str(directory / FULL_WEIGHTS_DIR / "ema.safetensors")))


def _tiny_directory(seed: int) -> Path:
    from omnirl_plugin_bagel.tiny import TINY_VERSION, save_tiny

    target = cache_dir() / "presets" / f"bagel-tiny-v{TINY_VERSION}-seed{seed}"
    return atomic_directory(target, lambda tmp: save_tiny(tmp, seed=seed))


def resolve_directory(path: str) -> Path:
    """A local checkpoint directory, or a hub id fetched with huggingface_hub (the files text-to-image reads)."""
    local = Path(path).expanduser()
    if local.exists() or path.startswith((".", "/", "~")):
        if not (local / "config.json").is_file():
            raise UsageError(f"'{path}' is not a BAGEL checkpoint directory (no config.json).",
                             hint="Point model.path at a local BAGEL-7B-MoT download, or use --preset tiny.")
        return local
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, allow_patterns=["*.json", "*.txt", "*.safetensors", "*.model"],
                                      ignore_patterns=["model*.safetensors"]))
    except Exception as exc:  # noqa: BLE001 (hub, network and auth errors all end here)
        raise UsageError(f"Could not load BAGEL from '{path}': it is not a local directory and the hub is "
                         "unreachable or does not have it.",
                         details=[f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"],
                         hint="Download the checkpoint to a directory and pass --set model.path=DIR, or use "
                         "--preset tiny.") from None


def load_components(directory: Path, dtype: torch.dtype, device: Any = "cpu") -> dict[str, Any]:
    """Everything text-to-image needs from a BAGEL directory: transformer, autoencoder, tokenizer."""
    transformer, config, report = load_transformer(directory, dtype, device)
    tokenizer, special_ids = load_tokenizer(directory)
    vae = load_autoencoder(directory, dtype, device)
    return {"transformer": transformer, "vae": vae, "tokenizer": tokenizer, "special_ids": special_ids,
            "config": config, "report": report}


def create_model(section: ModelSection, options: BagelOptions | None, device: Any) -> BagelModel:
    from omnirl_core.precision import concrete_dtype

    options = options or BagelOptions()
    dtype = DTYPES[concrete_dtype(section.dtype, torch.device(device).type)]
    path = checkpoint_path(section, "bagel", lambda: _tiny_directory(options.tiny_seed), DEFAULT_HUB_ID)
    c = load_components(resolve_directory(path), dtype, device)
    return BagelModel(c["transformer"], c["vae"], c["tokenizer"], c["special_ids"], options, torch.device(device),
                      dtype, c["report"])
