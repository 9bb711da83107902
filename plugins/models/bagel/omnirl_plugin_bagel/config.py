"""BAGEL's configuration as the released ``BAGEL-7B-MoT`` directory holds it (``config.json``,
``llm_config.json``, ``vit_config.json``), read into plain dataclasses, with the fields BAGEL's own loader
forces applied and reported.

Forced fields (the released ``llm_config.json`` is a plain Qwen2.5 configuration; BAGEL's loader overrides
three of its fields after reading it): ``qk_norm=True``, ``tie_word_embeddings=False`` and
``layer_module="Qwen2MoTDecoderLayer"``. ``max_latent_size`` is taken from the row count of the stored
``latent_pos_embed`` table when the two disagree (some checkpoints advertise a stale 32 for a 64-wide table).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omnirl_core.errors import UsageError

FORCED_LLM_FIELDS: dict[str, Any] = {
    "qk_norm": True,
    "tie_word_embeddings": False,
    "layer_module": "Qwen2MoTDecoderLayer",
}
"""What BAGEL's loader sets after reading ``llm_config.json``, whatever the file says."""

# The FLUX autoencoder's latent normalisation (BAGEL uses it as is): z <- scale * (z - shift)
VAE_SCALE_FACTOR = 0.3611
VAE_SHIFT_FACTOR = 0.1159


@dataclass
class LLMConfig:
    """The Qwen2.5 language model with Mixture-of-Transformers layers (two experts per layer): the keys of the
    released ``llm_config.json`` that the model reads, Qwen2.5-7B's values by default."""

    hidden_size: int = 3584
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    intermediate_size: int = 18944
    vocab_size: int = 152064
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    qk_norm: bool = True
    tie_word_embeddings: bool = False
    layer_module: str = "Qwen2MoTDecoderLayer"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self, where: str) -> None:
        problems = []
        if self.hidden_size % self.num_attention_heads:
            problems.append(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                            f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads {self.num_key_value_heads}")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act {self.hidden_act!r}: BAGEL's Qwen2.5 MLP is SwiGLU ('silu')")
        if self.layer_module != "Qwen2MoTDecoderLayer":
            problems.append(f"layer_module {self.layer_module!r}: only the MoT layer of the released model is "
                            "implemented")
        if problems:
            raise UsageError(f"The BAGEL language-model configuration in {where} is not usable.", details=problems,
                             hint="Point model.path at a BAGEL-7B-MoT directory (or one saved by this plugin).")


@dataclass
class BagelConfig:
    """The generation side of ``config.json`` plus the parsed language-model configuration."""

    llm: LLMConfig = field(default_factory=LLMConfig)
    latent_patch_size: int = 2
    max_latent_size: int = 64
    timestep_shift: float = 1.0
    vae_z_channels: int = 16
    vae_downsample: int = 8
    visual_gen: bool = True
    visual_und: bool = True
    vit: dict[str, Any] = field(default_factory=dict)
    """``vit_config.json`` as read (the SigLIP understanding tower; not built: text-to-image does not use it)."""
    forced: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """Fields the loader overrode: name -> (value in the files, value used)."""

    @property
    def patch_latent_dim(self) -> int:
        """Channels of one latent token: patch x patch x z (2 x 2 x 16 = 64)."""
        return self.latent_patch_size**2 * self.vae_z_channels

    @property
    def pixels_per_token(self) -> int:
        """Image pixels per latent token side: VAE downsample x patch (8 x 2 = 16)."""
        return self.vae_downsample * self.latent_patch_size

    def config_json(self) -> dict[str, Any]:
        """``config.json`` in the released layout (the language model's fields nested under ``llm_config``)."""
        return {
            "visual_gen": self.visual_gen,
            "visual_und": self.visual_und,
            "llm_config": llm_json(self.llm),
            "vit_config": self.vit,
            "vae_config": {"z_channels": self.vae_z_channels, "downsample": self.vae_downsample},
            "latent_patch_size": self.latent_patch_size,
            "max_latent_size": self.max_latent_size,
            "vit_max_num_patch_per_side": 70,
            "connector_act": "gelu_pytorch_tanh",
            "interpolate_pos": False,
            "timestep_shift": self.timestep_shift,
        }


def llm_json(llm: LLMConfig, released: bool = True) -> dict[str, Any]:
    """``llm_config.json`` as a Qwen2 configuration. ``released``: without the three fields BAGEL's loader
    forces, as in the released file (the loader must add them)."""
    out = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **asdict(llm)}
    if released:
        for name in FORCED_LLM_FIELDS:
            out.pop(name)
        out["tie_word_embeddings"] = False
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"'{path.parent}' is not a BAGEL checkpoint directory: {path.name} is missing.",
                         hint="Point model.path at a local BAGEL-7B-MoT download (config.json, llm_config.json, "
                         "ema.safetensors, ae.safetensors, tokenizer files), or use --preset tiny.") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON: {exc}.", hint="Re-download the file.") from None


def parse_llm_config(raw: dict[str, Any], where: str) -> tuple[LLMConfig, dict[str, tuple[Any, Any]]]:
    """A Qwen2 configuration dict -> ``LLMConfig`` with the forced fields applied (and which ones changed)."""
    rope = raw.get("rope_theta")
    if rope is None:
        rope = (raw.get("rope_parameters") or raw.get("rope_scaling") or {}).get("rope_theta", 1_000_000.0)
    scaling = raw.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise UsageError(f"{where}: rope_scaling {scaling} is not supported (BAGEL uses plain 1D RoPE).",
                         hint="Use the released llm_config.json.")
    known = {f: raw[f] for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                 "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings",
                                 "hidden_act") if f in raw}
    missing = {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"} - set(known)
    if missing:
        raise UsageError(f"{where} lacks {', '.join(sorted(missing))}.", hint="Use the released llm_config.json.")
    known.setdefault("num_key_value_heads", known["num_attention_heads"])
    forced = {}
    for name, value in FORCED_LLM_FIELDS.items():
        if raw.get(name) != value:
            forced[name] = (raw.get(name), value)
    llm = LLMConfig(rope_theta=float(rope), **known, **FORCED_LLM_FIELDS)
    llm.validate(where)
    return llm, forced


def read_config(directory: Path, pos_embed_rows: int | None = None) -> BagelConfig:
    """Read a BAGEL directory's configuration files. ``pos_embed_rows``: rows of the checkpoint's
    ``latent_pos_embed.pos_embed`` (fixes a stale ``max_latent_size``)."""
    raw = _read_json(directory / "config.json")
    llm_path = directory / "llm_config.json"
    llm_raw = _read_json(llm_path) if llm_path.is_file() else raw.get("llm_config")
    if not llm_raw:
        raise UsageError(f"'{directory}' has no llm_config.json and its config.json no llm_config.",
                         hint="Point model.path at a BAGEL-7B-MoT directory.")
    llm, forced = parse_llm_config(llm_raw, str(llm_path if llm_path.is_file() else directory / "config.json"))
    vit_path = directory / "vit_config.json"
    vit = _read_json(vit_path) if vit_path.is_file() else dict(raw.get("vit_config") or {})
    vae = raw.get("vae_config") or {}
    config = BagelConfig(
        llm=llm,
        latent_patch_size=int(raw.get("latent_patch_size", 2)),
        max_latent_size=int(raw.get("max_latent_size", 64)),
        timestep_shift=float(raw.get("timestep_shift", 1.0)),
        vae_z_channels=int(vae.get("z_channels", 16)),
        vae_downsample=int(vae.get("downsample", 8)),
        visual_gen=bool(raw.get("visual_gen", True)),
        visual_und=bool(raw.get("visual_und", True)),
        vit=vit,
        forced=forced,
    )
    if not config.visual_gen:
        raise UsageError(f"{directory / 'config.json'} has visual_gen=false: this checkpoint cannot generate images.",
                         hint="Use a BAGEL checkpoint with the generation expert (BAGEL-7B-MoT).")
    if pos_embed_rows is not None:
        side = math.isqrt(pos_embed_rows)
        if side * side != pos_embed_rows:
            raise UsageError(f"latent_pos_embed.pos_embed has {pos_embed_rows} rows, not a square grid.",
                             hint="The checkpoint is damaged; re-download ema.safetensors.")
        if side != config.max_latent_size:
            config.forced["max_latent_size"] = (config.max_latent_size, side)
            config.max_latent_size = side
    return config
