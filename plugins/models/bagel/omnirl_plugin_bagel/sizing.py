"""BAGEL-7B-MoT for the memory planner (``omnirl plan``): the full-size architecture on ``meta`` (``full_size.py``)
at the configured resolution and prompt length, its activations traced from the real network. See omnirl_core.planning.

What the plugin loads is one network and an autoencoder: ``transformer`` (the MoT language model with both
experts and the generation heads) and ``vae``. The understanding expert is not an encoder to offload: the prompt
runs through it in the same network (its keys and values in every layer), so it stays with the transformer. The
SigLIP tower, its connector and the LM head are in ``ema.safetensors`` but not built (text-to-image reads none).

The trace runs the network's own forward on meta tensors. Its experts are picked per token with ``nonzero``,
whose size the meta device cannot know; ``_Routing`` computes the small integer and boolean tensors the routing
comes from (prompt mask, layout, attention mask) on the CPU beside their meta twins, so that each expert sees the
real number of tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from omnirl_core.loop.distributed import shard_units
from omnirl_core.planning.activations import DenoiserProbe, meta_cast
from omnirl_core.planning.model import DecoderProbe, ModelSizing, lora_settings, torch_dtype
from omnirl_core.planning.sizing import checkpoint_numel, lora_numel
from omnirl_plugin_bagel.config import VAE_SCALE_FACTOR, VAE_SHIFT_FACTOR, BagelConfig, LLMConfig
from omnirl_plugin_bagel.full_size import LLM, MAX_LATENT_SIZE, VAE, full_size_components
from omnirl_plugin_bagel.model import LORA_TARGETS, BagelOptions, is_generation_only
from omnirl_plugin_bagel.transformer import BagelTransformer, rope_cos_sin
from omnirl_plugin_bagel.vae import AutoEncoder, AutoEncoderParams

MARKERS = 2
"""<|im_start|> and <|im_end|> around a prompt's text tokens."""
LAYER_PREFIX = re.compile(r"^language_model\.model\.layers\.\d+\.")


@functools.lru_cache(maxsize=1)
def _components() -> dict[str, torch.nn.Module]:
    return full_size_components()  # meta: no memory to keep


def trains(name: str, expert: str) -> bool:
    """Full fine-tuning: the chosen expert's language-model weights train, the generation heads stay frozen (as
    ``BagelModel.setup_training`` sets them)."""
    return name.startswith("language_model.") and (expert == "both" or (expert == "gen") == ("_moe_gen" in name))


def sharded_units(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """What the fsdp2 engine shards and gathers one at a time (``shard_units``): BAGEL's decoder layers, below
    ``language_model.model``; the whole network if it had no repeated blocks."""
    return shard_units(transformer) or [transformer]


def lora_target_names(transformer: torch.nn.Module, patterns: Sequence[str]) -> list[str]:
    """The linear modules LoRA adapts, as ``BagelModel.lora_target_names`` picks them (a regex matching the whole
    name, or a name suffix)."""
    regexes = [re.compile(p) for p in patterns]
    return [name for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)
            and any(r.fullmatch(name) or name.endswith("." + r.pattern) for r in regexes)]


class _Routing(TorchDispatchMode):
    """Keeps a CPU value beside each integer or boolean meta tensor computed from known values (factories, the
    prompt mask given with ``know``), and answers ``nonzero`` on meta with the real number of rows (an empty meta
    tensor of that shape). Floating-point tensors stay meta only. The CPU work runs outside every dispatch mode,
    so the planner's byte count sees only the meta tensors, as on the device."""

    _UNKNOWN = object()

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[int, torch.Tensor] = {}

    def know(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        self.values[id(tensor)] = value
        weakref.finalize(tensor, self.values.pop, id(tensor), None)

    def _value(self, x: Any) -> Any:
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        if isinstance(x, torch.Tensor) and x.is_meta:
            return self.values.get(id(x), self._UNKNOWN)
        return x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        values = tree_map(self._value, (args, kwargs))
        known = all(v is not self._UNKNOWN for v in tree_flatten(values)[0])
        if func is torch.ops.aten.nonzero.default:
            if not known:
                raise RuntimeError("BAGEL's memory probe cannot size an expert's tokens: nonzero of an unknown mask")
            with _disable_current_modes():
                rows = values[0][0].nonzero()
            out = torch.empty(rows.shape, dtype=rows.dtype, device="meta")
            self.know(out, rows)
            return out
        out = func(*args, **kwargs)
        if (known and isinstance(out, torch.Tensor) and out.is_meta and not out.is_floating_point()
                and not out.is_complex()):
            with _disable_current_modes():
                value_args, value_kwargs = values
                self.know(out, func(*value_args, **value_kwargs))
        elif func._schema.is_mutable:  # an in-place write of unknown values: forget what was known
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    self.values.pop(id(t), None)
        return out


@contextlib.contextmanager
def _together(*contexts: Any) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


class TracedTransformer(BagelTransformer):
    """``BagelTransformer`` as the planner traces it on meta: its own forward and layers, with

    - the expert routing sized (``_Routing``: the probe's prompts fill their padded width, mask all ones);
    - full fine-tuning training what the plugin trains: the planner's ``requires_grad_(True)`` ("every weight")
      becomes the chosen expert's language-model weights, so that the frozen embeddings (1.1 GB of bf16) and
      generation heads make no gradient;
    - gradient checkpointing through the planner's checkpoint arguments (fused attention when a layer is
      recomputed in the backward pass) and the routing;
    - the first layer backpropagating to its input like every later one: the planner adds what one layer adds
      between its one- and two-layer traces, and a first layer whose input needs no gradient (the frozen heads')
      keeps less (7 vs 28 MiB a sample at 512 px with checkpointing), which would make every later layer count
      as a second one."""

    def __init__(self, config: BagelConfig, expert: str):
        super().__init__(config)
        self.expert = expert
        self.routing = _Routing()
        self.checkpoint_kwargs: dict[str, Any] = {}

    def requires_grad_(self, requires_grad: bool = True) -> TracedTransformer:
        if not requires_grad:
            return super().requires_grad_(False)
        for name, p in self.named_parameters():
            p.requires_grad_(trains(name, self.expert))
        return self

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        self.gradient_checkpointing = True
        self.checkpoint_kwargs = dict(gradient_checkpointing_kwargs or {"use_reentrant": False})

    def _run_layers(self, h, layout, mask, past=None, keep_kv=False):
        if not (self.gradient_checkpointing and torch.is_grad_enabled()):
            return super()._run_layers(h, layout, mask, past, keep_kv)
        from torch.utils.checkpoint import checkpoint

        kwargs = dict(self.checkpoint_kwargs)
        contexts = kwargs.pop("context_fn", lambda: (contextlib.nullcontext(), contextlib.nullcontext()))

        def context_fn() -> tuple[Any, Any]:
            forward, recompute = contexts()
            return forward, _together(recompute, self.routing)

        llm = self.config.llm
        cos, sin = rope_cos_sin(layout.position, llm.head_dim, llm.rope_theta)
        for i, layer in enumerate(self.layers):
            h, _ = checkpoint(layer, h, layout.gen, cos, sin, mask, None if past is None else past[i],
                              context_fn=context_fn, **kwargs)
        return h, []

    def block_embeddings(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = super().block_embeddings(*args, **kwargs)
        if torch.is_grad_enabled() and not x.requires_grad:
            x.requires_grad_().register_post_accumulate_grad_hook(lambda leaf: setattr(leaf, "grad", None))
        return x

    def forward(self, latents, t, h, w, input_ids, text_mask, soi, eoi, prompt_kv=None):
        self.routing.know(text_mask, torch.ones(text_mask.shape, dtype=text_mask.dtype))
        with self.routing:
            return super().forward(latents, t, h, w, input_ids, text_mask, soi, eoi, prompt_kv)


def probe(config: Any, options: BagelOptions, llm: LLMConfig = LLM, max_latent_size: int = MAX_LATENT_SIZE,
          targets: tuple[str, ...] = (), cached: bool = True) -> DenoiserProbe:
    """The transformer with ``llm``'s width; inputs for ``rollout.height x width`` and prompts of
    ``max_prompt_tokens`` + 2 marker tokens (the cap: a batch pads to its longest prompt). ``cached``: the
    prompt's keys and values come from the conditioning and only the image block runs through the layers (the
    plugin's path while the text side is frozen); else prompt and image run as one sequence. ``targets``: the
    adapted modules' names below a decoder layer (or at the top level)."""
    dtype = torch_dtype(config)
    bagel = BagelConfig(llm=llm, max_latent_size=max_latent_size)
    step = bagel.pixels_per_token
    h, w = config.rollout.height // step, config.rollout.width // step
    text = options.max_prompt_tokens + MARKERS
    expert = options.train_expert

    def build(layers: int) -> torch.nn.Module:
        with torch.device("meta"):
            net = TracedTransformer(dataclasses.replace(bagel, llm=dataclasses.replace(llm, num_hidden_layers=layers)),
                                    expert)
        return meta_cast(net, dtype)

    def inputs(module: torch.nn.Module, batch: int) -> dict[str, Any]:
        device = next(module.parameters()).device
        out = {"latents": torch.randn(batch, h * w, bagel.patch_latent_dim, device=device, dtype=dtype),
               "t": torch.full((batch,), 0.5, device=device), "h": h, "w": w,
               "input_ids": torch.zeros(batch, text, dtype=torch.long, device=device),
               "text_mask": torch.ones(batch, text, dtype=torch.long, device=device), "soi": 0, "eoi": 1}
        if cached:
            out["prompt_kv"] = torch.zeros(batch, text, len(module.layers), 2, llm.num_key_value_heads,
                                           llm.head_dim, device=device, dtype=dtype)
        return out

    return DenoiserProbe(build=build, layers=llm.num_hidden_layers, blocks=lambda m: m.layers, inputs=inputs,
                         lora_targets=targets,
                         key=("bagel", dataclasses.astuple(llm), max_latent_size, str(dtype), h, w, text, cached,
                              expert, targets))


def decoder(config: Any, params: AutoEncoderParams = VAE) -> DecoderProbe:
    """The autoencoder's decode of one latent at the configured resolution."""
    dtype = torch_dtype(config)
    h, w = config.rollout.height // params.downsample, config.rollout.width // params.downsample

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return meta_cast(AutoEncoder(params, VAE_SCALE_FACTOR, VAE_SHIFT_FACTOR), dtype)

    def run(vae: torch.nn.Module, batch: int) -> Any:
        return vae.decode(torch.empty(batch, params.z_channels, h, w, device="meta", dtype=dtype))

    return DecoderProbe(build=build, run=run, key=("bagel", dataclasses.astuple(params), str(dtype), h, w))


def sizing(config: Any, options: BagelOptions | None) -> ModelSizing:
    options = options or BagelOptions()
    components = _components()
    transformer = components["transformer"]
    expert = options.train_expert
    rank, patterns = lora_settings(config, LORA_TARGETS[expert])
    if rank:
        names = lora_target_names(transformer, patterns)
        trainable = lora_numel(transformer, tuple(names), rank)
        text_trained = any(not is_generation_only(n) for n in names)
        targets = tuple(sorted({LAYER_PREFIX.sub("", n) for n in names}))
    else:
        trainable = sum(p.numel() for n, p in transformer.named_parameters() if trains(n, expert))
        text_trained, targets = expert != "gen", ()
    cached = options.prompt_kv_cache and not text_trained
    units = sharded_units(transformer)
    text = options.max_prompt_tokens + MARKERS
    dtype_bytes = torch_dtype(config).itemsize
    prompt_kv = text * LLM.num_hidden_layers * 2 * LLM.num_key_value_heads * LLM.head_dim * dtype_bytes
    step = BagelConfig().pixels_per_token
    h, w = config.rollout.height // step, config.rollout.width // step
    path = (f"the image block ({h * w} latent tokens + 2 markers) against the prompt's cached keys and values"
            if cached else f"prompt and image ({h * w} latent tokens + 2 markers) as one sequence (the text side "
            "trains, or prompt_kv_cache is off)")
    notes = [
        f"activations: the transformer traced on meta at {config.rollout.height}x{config.rollout.width}, {path}; "
        f"prompts at max_prompt_tokens {options.max_prompt_tokens} + 2 markers (the cap)"
        + (f", whose cached keys and values ({prompt_kv / 2**20:.1f} MiB a sample) are counted per sample"
           if cached else ""),
        ("text CFG: the unconditional (text-dropped) branch is a second call after the conditional one, not "
         "batched with it, and without grad in training: it doubles the compute, not a call's peak"),
        ("not counted: the SigLIP understanding tower, its connector and the LM head (stored in ema.safetensors, "
         "not built: text-to-image reads none of them)"),
    ]
    return ModelSizing(
        components={"transformer": checkpoint_numel(transformer), "vae": checkpoint_numel(components["vae"])},
        trained=("transformer",),
        trainable=trainable,
        lora=rank is not None,
        encoders=("vae",),
        probe=probe(config, options, targets=targets, cached=cached),
        decoder=decoder(config),
        largest_block=max(checkpoint_numel(b) for b in units),
        per_sample_bytes=prompt_kv if cached else 0,
        notes=notes,
    )
