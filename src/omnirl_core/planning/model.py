"""What a model plugin tells the memory planner: the one contract addition of the planner.

A model's spec names a function (``ModelSpec.sizing``, ``"module:attr"``) that takes the run's config and the
model's validated options and returns a ``ModelSizing`` built from the full-size architecture on the ``meta``
device. Everything else (dtypes, sharding, copies, the device budget) the planner derives from the config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omnirl_core.planning.activations import DenoiserProbe
from omnirl_core.planning.sizing import checkpoint_numel, component_counts, trainable_numel

if TYPE_CHECKING:
    import torch

    from omnirl_core.config import RunConfig


@dataclass
class DecoderProbe:
    """The VAE decode of a rollout: ``build()`` the decoder module on meta; ``run(module, batch)`` decodes
    ``batch`` latents of the configured shape (meta tensors)."""

    build: Callable[[], torch.nn.Module]
    run: Callable[[Any, int], object]
    key: tuple[Any, ...] = ()
    """Everything the trace depends on; equal non-empty keys share it within a process."""


@dataclass
class ModelSizing:
    """The full-size model at the configured variant, as the planner needs it.

    ``components``: parameter count per component (each tensor a checkpoint holds once), e.g. transformer,
    text_encoder, vae. ``trained``: the components training updates (a sharded engine shards them; a reference
    copy or an EMA copies them). ``trainable``: the parameters training updates (the LoRA adapters' count, or
    the trained components' whole count). ``lora``: adapters (True) or full fine-tuning. ``encoders``: frozen
    components used only before and after the trained network (text encoders, VAE): the ones an offload moves
    off the device. ``probe``: traces the trained network's activations; None falls back to a generic transformer
    estimate from ``hidden``, ``layers`` and ``tokens`` (per sample). ``decoder``: traces the VAE decode (None: not
    counted). ``largest_block``: parameters of the largest sharded block (what FSDP2 gathers at once)."""

    components: dict[str, int]
    trained: tuple[str, ...]
    trainable: int
    lora: bool
    encoders: tuple[str, ...] = ()
    probe: DenoiserProbe | None = None
    decoder: DecoderProbe | None = None
    largest_block: int = 0
    hidden: int = 0
    layers: int = 0
    tokens: int = 0
    per_sample_bytes: int = 0
    """Activation bytes per sample outside the traced or estimated layers (e.g. an LM head's float32 logits)."""
    experts: int = 0
    """Parameters of the MoE experts among the trained components' (full fine-tuning's trainable ones): what
    expert parallelism splits; 0: no MoE."""
    tensor_split: int = 0
    """Parameters of the trained components' layers that tensor parallelism splits (column-, row- and vocab-parallel
    linear and embedding layers, the experts not included); the rest of them (norms, a MoE router) every
    tensor-parallel rank holds whole."""
    replicated: int = 0
    """Parameters of the trained components' layers a tensor / expert-parallel engine holds whole on every rank (norms,
    a MoE router): with LoRA, of the frozen base (in full fine-tuning they are ``trainable - experts - tensor_split``)."""
    lora_tensor_split: int = 0
    """Of the LoRA adapters (``trainable`` with LoRA), the parameters a tensor-parallel engine splits (``B`` of a
    column-parallel layer, ``A`` of a row-parallel one); 0: the adapters counted whole on every rank."""
    parallel_units: dict[str, tuple[int, str]] = field(default_factory=dict)
    """What a parallel degree splits and so must divide, by kind: e.g. ``{"tensor": (4, "key/value heads"),
    "expert": (128, "experts")}``. A model without a ``tensor`` / ``expert`` entry cannot be planned under that
    kind of parallelism."""
    notes: list[str] = field(default_factory=list)
    checkpointable: bool = True
    """The trained network can recompute its activations (``model.options.gradient_checkpointing``); False where
    the model refuses it, so the planner does not suggest it."""
    preset: str | None = None
    """The preset whose architecture this describes (``model.preset``, e.g. ``tiny``); None: the released
    full-size model. A sizing function that knows the configured preset's architecture sets it."""


def lora_settings(config: RunConfig, default_targets: tuple[str, ...] | str
                  ) -> tuple[int | None, tuple[str, ...] | str]:
    """(rank or None for full fine-tuning, targets) from ``config.model.lora``; the model's default targets as it
    declares them: module names, or one regex over whole module names (a token model's)."""
    lora = config.model.lora
    targets = tuple(lora.target_modules) if lora.target_modules else default_targets
    return (lora.rank if lora.enabled else None), targets


def model_dtype(config: RunConfig) -> str:
    """The weights' dtype: ``model.dtype``, with ``auto`` bfloat16 on an accelerator and float32 on the CPU."""
    dtype = config.model.dtype
    if dtype == "auto":
        return "float32" if config.run.device == "cpu" else "bfloat16"
    return dtype


def torch_dtype(config: RunConfig) -> torch.dtype:
    """The torch dtype of the run's weights (``model.dtype``, ``auto`` resolved as the planner does)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[model_dtype(config)]


def vae_decoder(build: Callable[[], torch.nn.Module], latent_shape: tuple[int, ...], dtype: torch.dtype,
                key: tuple[Any, ...] = ()) -> DecoderProbe:
    """A ``DecoderProbe`` for a diffusers VAE: ``build()`` makes it (on meta, in ``dtype``); one decode of a
    ``(batch, *latent_shape)`` latent."""
    import torch

    return DecoderProbe(build=build, run=lambda vae, batch: vae.decode(
        torch.empty(batch, *latent_shape, device="meta", dtype=dtype), return_dict=False), key=key)


def on_meta(make: Callable[[], torch.nn.Module], dtype: torch.dtype) -> torch.nn.Module:
    """``make()``'s module built on the ``meta`` device (no storage) in ``dtype``: what a probe's ``build`` gives."""
    import torch

    from omnirl_core.planning.activations import meta_cast

    with torch.device("meta"):
        return meta_cast(make(), dtype)


def layers_builder(cls: Callable[..., torch.nn.Module], arch: dict[str, Any], dtype: torch.dtype,
                   key: str = "num_layers") -> Callable[[int], torch.nn.Module]:
    """A probe's ``build`` for a module configured by keyword arguments: ``cls(**arch)`` with ``key`` (its layer
    count) set to the layers asked for, on ``meta`` in ``dtype``."""
    return lambda layers: on_meta(lambda: cls(**{**arch, key: layers}), dtype)


def pipeline_sizing(config: RunConfig, components: dict[str, torch.nn.Module], trained: tuple[str, ...],
                    default_targets: tuple[str, ...], blocks: Iterable[torch.nn.Module], encoders: tuple[str, ...],
                    probe: DenoiserProbe | None, decoder: DecoderProbe | None, preset: str | None = None
                    ) -> ModelSizing:
    """The ``ModelSizing`` of a pipeline of full-size ``components`` (on meta) that trains the ``trained`` ones:
    the adapters of ``config.model.lora`` (on ``default_targets`` when it names none) or those components whole;
    ``encoders``: those of these names the pipeline has; ``blocks``: the sharded blocks of a trained component;
    ``preset``: the preset these components are (None: the released model)."""
    rank, targets = lora_settings(config, default_targets)
    return ModelSizing(
        components=component_counts(components),
        trained=trained,
        trainable=trainable_numel([components[name] for name in trained], targets, rank),
        lora=rank is not None,
        encoders=tuple(name for name in encoders if name in components),
        probe=probe,
        decoder=decoder,
        largest_block=max(checkpoint_numel(b) for b in blocks),
        preset=preset,
    )
