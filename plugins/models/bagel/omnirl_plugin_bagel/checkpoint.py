"""Reading and writing BAGEL checkpoints in the released ``BAGEL-7B-MoT`` layout:

    config.json  llm_config.json  vit_config.json      configuration (see ``config.py``)
    ema.safetensors                                    all BAGEL weights (or model.safetensors, or shards
                                                       listed by a *.safetensors.index.json)
    ae.safetensors                                     the FLUX autoencoder (encoder.*, decoder.*)
    tokenizer files                                    the Qwen2 tokenizer

Text-to-image reads ``language_model.model.*`` and the four generation heads; the LM head and the SigLIP
understanding tower (``vit_model.*``, ``connector.*``, ``vit_pos_embed.*``) are left on disk, and the load
report says so.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from omnirl_core.errors import UsageError
from omnirl_plugin_bagel.config import VAE_SCALE_FACTOR, VAE_SHIFT_FACTOR, BagelConfig, llm_json, read_config
from omnirl_plugin_bagel.transformer import BagelTransformer
from omnirl_plugin_bagel.vae import AutoEncoder, AutoEncoderParams

log = logging.getLogger("omnirl.bagel")

WEIGHT_FILES = ("ema.safetensors", "model.safetensors")
INDEX_FILES = ("ema.safetensors.index.json", "model.safetensors.index.json")
AE_FILE = "ae.safetensors"
UNUSED_PREFIXES = {
    "language_model.lm_head.": "LM head (text output)",
    "vit_model.": "SigLIP understanding tower",
    "connector.": "understanding connector",
    "vit_pos_embed.": "understanding position table",
}
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")


@dataclass
class LoadReport:
    """What a load read, forced and left out."""

    weights: list[str] = field(default_factory=list)
    forced: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    not_used: dict[str, int] = field(default_factory=dict)
    """Checkpoint tensors not loaded, counted per part (text-to-image does not read them)."""

    def lines(self) -> list[str]:
        out = [f"weights: {', '.join(self.weights)}"]
        out += [f"forced {name}: {was!r} in the files -> {now!r}" for name, (was, now) in self.forced.items()]
        out += [f"not loaded (text-to-image does not use it): {part}, {n} tensors" for part, n in self.not_used.items()]
        if not any(part.startswith("SigLIP") for part in self.not_used):
            out.append("SigLIP understanding tower: not in the checkpoint, not built (text-to-image does not use it)")
        return out


def weight_files(directory: Path) -> list[Path]:
    """The files holding BAGEL's weights: ema.safetensors first (what BAGEL's own inference reads), else
    model.safetensors, else the shards a safetensors index lists."""
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return [directory / name]
    for name in INDEX_FILES:
        index = directory / name
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
            files = [directory / f for f in dict.fromkeys(weight_map.values())]
            absent = [f.name for f in files if not f.is_file()]
            if absent or not files:
                raise UsageError(f"{index} lists shards that are not there: {absent or 'none listed'}.",
                                 hint="Finish the download (all shards) or re-download the checkpoint.")
            return files
    found = sorted(p.name for p in directory.glob("*")) if directory.is_dir() else []
    raise UsageError(f"No BAGEL weights in '{directory}': expected ema.safetensors, model.safetensors or a "
                     "*.safetensors.index.json with its shards.", details=[f"found: {found[:12]}"],
                     hint="Download ByteDance-Seed/BAGEL-7B-MoT to a directory and pass --set model.path=DIR, or "
                     "use --preset tiny. Only safetensors files are read.")


def _shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    from safetensors import safe_open

    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors file, not a dict)
                out[key] = (tuple(f.get_slice(key).get_shape()), file)
    return out


def _read(entries: dict[str, tuple[tuple[int, ...], Path]], keys: list[str], dtype: torch.dtype
          ) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for key in keys:
        by_file.setdefault(entries[key][1], []).append(key)
    out = {}
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                out[name] = f.get_tensor(name).to(dtype)
    return out


def load_transformer(directory: Path, dtype: torch.dtype, device: Any = "cpu"
                     ) -> tuple[BagelTransformer, BagelConfig, LoadReport]:
    """Build BAGEL's generation network from a checkpoint directory: the configuration with the forced fields,
    then the weights (every tensor the network has must be in the checkpoint)."""
    directory = Path(directory)
    files = weight_files(directory)
    entries = _shapes(files)
    rows = entries.get("latent_pos_embed.pos_embed", ((None,), None))[0][0]
    config = read_config(directory, rows)
    with torch.device("meta"):
        transformer = BagelTransformer(config)
    expected = transformer.state_dict()
    missing = [k for k in expected if k not in entries]
    if missing:
        raise UsageError(f"The BAGEL checkpoint in '{directory}' lacks {len(missing)} tensors the model needs.",
                         details=[f"e.g. {', '.join(missing[:4])}"],
                         hint="Check that the files belong to BAGEL-7B-MoT and are complete.")
    wrong = [f"{k}: {entries[k][0]} in the file, {tuple(v.shape)} expected" for k, v in expected.items()
             if entries[k][0] != tuple(v.shape)]
    if wrong:
        raise UsageError(f"The BAGEL checkpoint in '{directory}' does not match its configuration.",
                         details=wrong[:5], hint="config.json / llm_config.json must be the ones saved with the weights.")
    report = LoadReport(weights=[f.name for f in files], forced=dict(config.forced))
    for key in entries:
        if key not in expected:
            part = next((name for prefix, name in UNUSED_PREFIXES.items() if key.startswith(prefix)), "other")
            report.not_used[part] = report.not_used.get(part, 0) + 1
    transformer.load_state_dict(_read(entries, list(expected), dtype), assign=True)
    transformer.latent_pos_embed.pos_embed.requires_grad_(False)
    transformer = transformer.to(device)
    for line in report.lines():
        log.info("BAGEL %s: %s", directory.name, line)
    return transformer, config, report


def load_autoencoder(directory: Path, dtype: torch.dtype, device: Any = "cpu") -> AutoEncoder:
    path = Path(directory) / AE_FILE
    if not path.is_file():
        raise UsageError(f"'{directory}' has no {AE_FILE} (BAGEL's FLUX autoencoder).",
                         hint="Download ae.safetensors of BAGEL-7B-MoT into the model directory.")
    entries = _shapes([path])
    params = AutoEncoderParams.from_shapes({k: s for k, (s, _) in entries.items()}, str(path))
    with torch.device("meta"):
        vae = AutoEncoder(params, VAE_SCALE_FACTOR, VAE_SHIFT_FACTOR)
    vae.load_state_dict(_read(entries, list(entries), dtype), assign=True, strict=True)
    return vae.to(device).eval().requires_grad_(False)


def load_tokenizer(directory: Path) -> tuple[Any, dict[str, int]]:
    """The checkpoint's Qwen2 tokenizer and the ids of the four special tokens BAGEL uses. Loaded once per
    process and directory state (parsing 152k BPE merges takes seconds; the tokenizer is only read)."""
    files = sorted(p for p in Path(directory).glob("*") if p.name.startswith(("tokenizer", "vocab", "merges",
                                                                           "special_tokens", "added_tokens")))
    stamp = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files)
    tokenizer, ids = _load_tokenizer(str(Path(directory).resolve()), stamp)
    return tokenizer, dict(ids)


@functools.lru_cache(maxsize=8)
def _load_tokenizer(directory: str, stamp: tuple) -> tuple[Any, dict[str, int]]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise UsageError(f"No usable tokenizer in '{directory}': {str(exc).splitlines()[0]}",
                         hint="The Qwen2 tokenizer files (tokenizer.json or vocab.json + merges.txt) come with "
                         "BAGEL-7B-MoT; download them into the model directory.") from None
    vocab = tokenizer.get_vocab()
    absent = [t for t in SPECIAL_TOKENS if t not in vocab]
    if absent:
        raise UsageError(f"The tokenizer in '{directory}' lacks BAGEL's special tokens {absent}.",
                         hint="Use the Qwen2 tokenizer shipped with BAGEL-7B-MoT.")
    return tokenizer, {t: vocab[t] for t in SPECIAL_TOKENS}


def save_checkpoint(directory: Path, config: BagelConfig, weights: dict[str, torch.Tensor],
                    vae_weights: dict[str, torch.Tensor] | None = None, tokenizer: Any = None) -> list[str]:
    """Write the released layout: config.json, llm_config.json (as released: without the forced fields),
    vit_config.json, ema.safetensors (``weights``, released names), and, when given, ae.safetensors and the
    tokenizer files. Returns the names written."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.config_json(), indent=2))
    (directory / "llm_config.json").write_text(json.dumps(llm_json(config.llm), indent=2))
    (directory / "vit_config.json").write_text(json.dumps(config.vit, indent=2))
    save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(directory / "ema.safetensors"),
              metadata={"format": "pt"})
    written = ["config.json", "llm_config.json", "vit_config.json", "ema.safetensors"]
    if vae_weights is not None:
        save_file({k: v.detach().contiguous() for k, v in vae_weights.items()}, str(directory / AE_FILE),
                  metadata={"format": "pt"})
        written.append(AE_FILE)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
        written.append("tokenizer files")
    return written
