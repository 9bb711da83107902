"""Component specs and the registries that resolve a name to one of them."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from omnirl_core.errors import PluginError, did_you_mean

if TYPE_CHECKING:
    from omnirl_core.config import ModelSection

log = logging.getLogger("omnirl")


def load_object(ref: object) -> Any:
    """Import ``"module:attr"`` (or return ``ref`` when it is already an object)."""
    if not isinstance(ref, str):
        return ref
    module_name, _, attr = ref.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


@dataclass
class ComponentSpec:
    """What every component declares. ``factory`` and ``config`` may be ``"module:attr"`` strings."""

    kind: ClassVar[str] = "component"
    name: str
    factory: str | Callable[..., Any]
    description: str = ""
    aliases: tuple[str, ...] = ()
    config: str | type[BaseModel] | None = None
    plugin: str = ""  # filled in by the registry: the plugin that registered it
    version: str = ""
    first_party: bool = False  # filled in by the registry: shipped with omnirl (wins an unqualified name)

    @property
    def qualified_name(self) -> str:
        return f"{self.plugin}:{self.name}" if self.plugin else self.name

    def load_factory(self) -> Callable[..., Any]:
        return load_object(self.factory)

    def load_config(self) -> type[BaseModel] | None:
        """The pydantic class of this component's ``options`` (None when it has none)."""
        return load_object(self.config) if self.config is not None else None

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "plugin": self.plugin,
            "version": self.version,
            "aliases": list(self.aliases),
            "description": self.description,
        }


@dataclass(frozen=True)
class ModelLimits:
    """What a model constrains, known without loading weights: checked at resolution (and ``--dry-run``)."""

    guidance: str = "cfg"
    """How ``rollout.guidance_scale`` is used: ``cfg`` true classifier-free guidance (an unconditional branch),
    ``embedded`` guidance distilled into the network (the scale is an input), ``none`` (the scale must be 1)."""
    size_multiple: int = 1
    """Height and width must be multiples of it (VAE downsampling x transformer patch)."""
    frame_multiple: int | None = None
    """Videos: ``num_frames`` must be ``k * frame_multiple + 1``; None: an image model (num_frames unset)."""
    max_size: int | None = None
    """The largest height or width in pixels the network can take (its position embedding's range, e.g. a RoPE
    table of fixed length); None: no cap declared."""


@dataclass
class ModelSpec(ComponentSpec):
    kind: ClassVar[str] = "model"
    capabilities: frozenset[str] = frozenset()
    presets: tuple[str, ...] = ()
    default_path: str = ""
    recipe_defaults: dict[str, Any] = field(default_factory=dict)
    """Config values this model suggests (lowest layer, under the recipe and --set)."""
    preset_defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Extra suggested values per preset, e.g. a small resolution for ``tiny``."""
    sizing: str | Callable[..., Any] | None = None
    """``"module:attr"`` of ``(config, options) -> omnirl_core.planning.model.ModelSizing``: the full-size architecture
    on ``meta`` for ``omnirl plan`` (None: the model cannot be planned)."""
    limits: ModelLimits | dict[str | None, ModelLimits] | str | Callable[..., ModelLimits] | None = None
    """A ``ModelLimits``; a dict of them by preset (key None: released checkpoints); or ``"module:attr"`` of a
    cheap function ``(model_section, options) -> ModelLimits`` when they depend on the checkpoint or an option
    (no torch, no weights). None: nothing is checked."""

    def limits_for(self, section: ModelSection, options: BaseModel | None) -> ModelLimits:
        if isinstance(self.limits, dict):
            return self.limits.get(section.preset, self.limits.get(None, ModelLimits()))
        if self.limits is None or isinstance(self.limits, ModelLimits):
            return self.limits or ModelLimits()
        return load_object(self.limits)(section, options)

    def summary(self) -> dict[str, Any]:
        return {
            **super().summary(),
            "capabilities": sorted(self.capabilities),
            "presets": list(self.presets),
            "default_path": self.default_path,
        }


@dataclass
class AlgorithmSpec(ComponentSpec):
    kind: ClassVar[str] = "algorithm"
    requires: frozenset[str] = frozenset()
    needs_reference: bool = False
    needs_ema: bool = False
    min_group_size: int = 2
    """Samples per prompt the algorithm needs (group-relative advantages, best-vs-worst pairs: 2)."""
    recipe_defaults: dict[str, Any] = field(default_factory=dict)
    preset_defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Suggested values when the model runs a given preset, e.g. ``tiny``: random-weight development models
    learn with other hyperparameters than released checkpoints. Applied above the model's preset values."""

    def summary(self) -> dict[str, Any]:
        return {
            **super().summary(),
            "requires": sorted(self.requires),
            "needs_reference": self.needs_reference,
            "needs_ema": self.needs_ema,
        }


@dataclass
class EngineSpec(ComponentSpec):
    kind: ClassVar[str] = "engine"
    roles: frozenset[str] = frozenset()
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    shards: bool = False
    """A train engine that splits parameters, gradients and optimizer state over its ranks (``omnirl plan``
    divides them by ``run.train_workers``); False: every rank holds everything."""
    batch_option: str = ""
    """A rollout engine's option that caps how many samples one model call batches (``omnirl plan`` suggests
    lowering it when a rollout does not fit); empty: the engine has none."""
    parallel: dict[str, str] = field(default_factory=dict)
    """A train engine's kinds of parallelism over its ranks (``data``, ``tensor``, ``expert``, ``sequence``, ...),
    each with the engine option that sets its degree (empty: what the other degrees leave of
    ``run.train_workers``; an option left None: every rank); empty: none declared. ``omnirl plan`` reads the
    degrees: ``tensor`` splits the trained layers (weights, gradients, optimizer state, most activations),
    ``expert`` the MoE experts, ``sequence`` the tokens of a sequence."""
    trains_lora: bool = True
    """A train engine that trains LoRA adapters (False: full fine-tuning only; ``omnirl plan`` then never suggests
    ``model.lora.enabled=true``)."""
    keeps_model: bool = False
    """A train engine that trains its own copy of the trained network, split by its ``parallel`` degrees (e.g.
    megatron's GPT blocks), and keeps the model plugin's module whole on every rank besides it (the policy the
    rollout samples and the weights export to), gathering every rank's shards into it after each optimizer step.
    ``omnirl plan`` counts the whole module, the rank's shards and that gather."""

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "roles": sorted(self.roles), "devices": sorted(self.devices),
                "shards": self.shards, "parallel": dict(self.parallel)}


@dataclass
class RewardSpec(ComponentSpec):
    kind: ClassVar[str] = "reward"
    modality: str | tuple[str, ...] = "image"
    """The output kind it scores (a model capability: 'image', 'video', ...), several, or 'any'."""
    resources: dict[str, float] = field(default_factory=dict)
    default_prompts: str | Sequence[str] | None = None
    """Prompts this reward makes sense with (a list, ``"module:attr"``, or a shipped set ``"builtin:NAME"`` with its
    own test split), used when none are given."""
    input_fields: str | Sequence[str] = ()
    """Fields every prompt record must hold for this reward (e.g. a reference answer): names, or
    ``"module:attr"`` of a function ``(options) -> names`` when an option picks them. Checked at dry-run."""

    @property
    def modalities(self) -> tuple[str, ...]:
        return (self.modality,) if isinstance(self.modality, str) else tuple(self.modality)

    def summary(self) -> dict[str, Any]:
        return {
            **super().summary(),
            "modality": ", ".join(self.modalities),
            "resources": dict(self.resources),
        }


@dataclass
class DeviceSpec(ComponentSpec):
    """Hardware. ``factory`` is the probe: ``() -> int`` (devices available), cheap, never raises."""

    kind: ClassVar[str] = "device"
    torch_device: str = "cpu"
    backend: str = "gloo"
    ray_resource: str = "CPU"
    visible_devices_env: str = ""
    priority: int = 0
    """``--device auto`` picks the available device with the highest priority."""

    def available(self) -> int:
        try:
            return int(self.load_factory()())
        except Exception:  # noqa: BLE001 - a probe must never take a run down
            return 0

    def summary(self) -> dict[str, Any]:
        return {
            **super().summary(),
            "torch_device": self.torch_device,
            "backend": self.backend,
            "ray_resource": self.ray_resource,
            "visible_devices_env": self.visible_devices_env,
            "priority": self.priority,
        }


@dataclass
class TrackerSpec(ComponentSpec):
    """An experiment tracker (TensorBoard, W&B, ...). ``factory(options)`` returns the tracker; see
    ``omnirl_core.loop.trackers`` for what it is called with."""

    kind: ClassVar[str] = "tracker"
    requires: tuple[str, ...] = ()
    """Python packages the tracker imports when it starts (named in errors and listings)."""

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "requires": list(self.requires)}


SPEC_FOR_KIND: dict[str, type[ComponentSpec]] = {
    cls.kind: cls for cls in (ModelSpec, AlgorithmSpec, EngineSpec, RewardSpec, DeviceSpec, TrackerSpec)
}


class Registry:
    """Components of one kind. Duplicate names are kept; picking an ambiguous one needs ``plugin:name``."""

    def __init__(self, kind: str):
        self.kind = kind
        self._specs: list[ComponentSpec] = []

    def add(self, spec: ComponentSpec) -> None:
        expected = SPEC_FOR_KIND[self.kind]
        if not isinstance(spec, expected):
            raise PluginError(
                f"Plugin '{spec.plugin}' registered a {type(spec).__name__} through the {self.kind} hook.",
                hint=f"Register a {expected.__name__} in omnirl_register_{self.kind}s.",
            )
        self._specs.append(spec)

    def __iter__(self) -> Iterator[ComponentSpec]:
        return iter(sorted(self._specs, key=lambda s: (s.name, s.plugin)))

    def __len__(self) -> int:
        return len(self._specs)

    def names(self) -> list[str]:
        return sorted({s.name for s in self._specs})

    def resolve(self, name: str) -> ComponentSpec:
        plugin, sep, short = name.rpartition(":")
        candidates = [
            s for s in self._specs if short == s.name or short in s.aliases
        ]
        if sep:
            candidates = [s for s in candidates if s.plugin == plugin]
        if len(candidates) == 1:
            return candidates[0]
        if not candidates:
            known = self.names()
            aliases = [a for s in self._specs for a in s.aliases]
            installed = ", ".join(known) if known else "none"
            raise PluginError(
                f"Unknown {self.kind} '{name}'.{did_you_mean(short, known + aliases)} Installed: {installed}.",
                hint=(
                    f"Install a plugin that provides it (pip install omnirl-plugin-<name>); "
                    f"see `omnirl list plugins` and `omnirl list {self.kind}s`."
                ),
            )
        options = ", ".join(s.qualified_name for s in candidates)
        ours = [s for s in candidates if s.first_party]
        if not sep and len(ours) == 1:
            others = ", ".join(s.qualified_name for s in candidates if not s.first_party)
            log.warning("%s '%s' is also provided by %s; using omnirl's own (%s). Pick another by its qualified "
                        "name.", self.kind, name, others, ours[0].qualified_name)
            return ours[0]
        raise PluginError(
            f"The {self.kind} name '{name}' is ambiguous: {len(candidates)} plugins provide it ({options}).",
            hint=f"Pick one by its qualified name, e.g. '{candidates[0].qualified_name}'.",
        )
