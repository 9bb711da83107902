"""Plugin discovery: entry points in the group ``omnirl.plugins``, each loaded on its own. A plugin declares
its components in an ``omnirl.toml`` manifest beside its ``__init__.py`` (``omnirl_core.manifest``), or
registers them from hooks (``omnirl_core.hookspecs``), or both.

A plugin that fails to import, whose manifest is wrong, or whose hook raises, is recorded as broken with its
error and skipped; it becomes an error only when a run selects one of its components, or always with
``OMNIRL_STRICT_PLUGINS=1``.

Environment:
  OMNIRL_AUTOLOAD=0          load no entry points (tests register their plugins explicitly)
  OMNIRL_PLUGINS=a.b,c       also load these modules as plugins (local, uninstalled plugins)
  OMNIRL_DISABLE_PLUGINS=x,y skip these plugins (entry-point names)
  OMNIRL_STRICT_PLUGINS=1    any plugin failure is fatal
"""

from __future__ import annotations

import importlib
import os
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any, Literal, overload

import pluggy

from omnirl_core import hookspecs
from omnirl_core.errors import OmnirlError, PluginError
from omnirl_core.manifest import manifest_specs
from omnirl_core.project import ENTRY_POINT_GROUP, PROJECT
from omnirl_core.registry import (
    AlgorithmSpec,
    ComponentSpec,
    DeviceSpec,
    EngineSpec,
    ModelSpec,
    Registry,
    RewardSpec,
    TrackerSpec,
)


def _env_list(name: str) -> list[str]:
    return [part.strip() for part in os.environ.get(name, "").split(",") if part.strip()]


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in ("0", "false", "no", "off", "")


@dataclass
class PluginInfo:
    name: str
    module: str
    distribution: str = ""
    version: str = ""
    status: str = "ok"  # ok | broken | disabled
    error: str = ""
    components: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module": self.module,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "error": self.error,
            "components": list(self.components),
        }


FIRST_PARTY = frozenset({
    "omnirl", "omnirl-plugin-cpu", "omnirl-plugin-cuda", "omnirl-plugin-ascend",
    "omnirl-plugin-diffusers", "omnirl-plugin-torch", "omnirl-plugin-fsdp2", "omnirl-plugin-transformers",
    "omnirl-plugin-qwen-image", "omnirl-plugin-wan22", "omnirl-plugin-sd35", "omnirl-plugin-qwen3-omni",
    "omnirl-plugin-flowgrpo", "omnirl-plugin-mixgrpo", "omnirl-plugin-dancegrpo", "omnirl-plugin-grpo-guard",
    "omnirl-plugin-dpo", "omnirl-plugin-nft", "omnirl-plugin-gspo",
    "omnirl-plugin-color", "omnirl-plugin-jpeg", "omnirl-plugin-ocr", "omnirl-plugin-vlm-judge",
    "omnirl-plugin-answer-match", "omnirl-plugin-clipscore", "omnirl-plugin-pickscore", "omnirl-plugin-aesthetic",
    "omnirl-plugin-hpsv2", "omnirl-plugin-imagereward", "omnirl-plugin-remote",
    "omnirl-plugin-geneval", "omnirl-plugin-video", "omnirl-plugin-bagel", "omnirl-plugin-vllm-omni", "omnirl-plugin-vllm", "omnirl-plugin-sglang", "omnirl-plugin-veomni",
    "omnirl-plugin-megatron",
    "omnirl-plugin-flux", "omnirl-plugin-qwen-image-edit", "omnirl-plugin-edit-consistency",
    "omnirl-plugin-tensorboard", "omnirl-plugin-wandb",
    "omnirl-plugin-speech-signal", "omnirl-plugin-asr-error", "omnirl-plugin-speaker-similarity",
})
"""Distributions of this repository: an unqualified name that a third-party plugin registers too resolves to
theirs (with a warning), so installing a plugin never breaks a command that worked."""


class PluginManager:
    """Loads plugins and fills one registry per component kind."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.registries: dict[str, Registry] = {kind: Registry(kind) for kind in hookspecs.KINDS}
        self.strict = _env_flag("OMNIRL_STRICT_PLUGINS", False)

    # -- loading -------------------------------------------------------------------------------
    def load_entry_points(self) -> None:
        disabled = set(_env_list("OMNIRL_DISABLE_PLUGINS"))
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if ep.name in self.plugins:
                continue  # the same distribution seen twice on sys.path
            dist = getattr(ep, "dist", None)
            info = PluginInfo(
                name=ep.name,
                module=ep.value,
                distribution=dist.metadata["Name"] if dist else "",
                version=dist.version if dist else "",
            )
            if ep.name in disabled:
                info.status = "disabled"
                self.plugins[ep.name] = info
                continue
            try:
                module = ep.load()
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - a broken plugin (even one that calls sys.exit) must not take the CLI down
                self._mark_broken(info, exc)
                continue
            self._register(module, info)

    def load_modules(self, names: list[str]) -> None:
        for module_name in names:
            info = PluginInfo(name=module_name.rsplit(".", 1)[-1], module=module_name)
            try:
                module = importlib.import_module(module_name)
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported as a broken plugin
                self._mark_broken(info, exc)
                continue
            self._register(module, info)

    def register(self, plugin: ModuleType | object, name: str, *, version: str = "") -> PluginInfo:
        """Register a plugin object directly (tests, embedding applications)."""
        info = PluginInfo(name=name, module=getattr(plugin, "__name__", type(plugin).__name__), version=version)
        self._register(plugin, info)
        return info

    def _register(self, plugin: object, info: PluginInfo) -> None:
        try:
            self.pm.register(plugin, name=info.name)
            self.pm.check_pending()  # a misspelt hook name is an error, not silence
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported as a broken plugin
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            self._mark_broken(info, exc)
            return
        self.plugins[info.name] = info
        try:
            for spec in manifest_specs(plugin, info.name):
                self._add(spec.kind, spec, info)
            for kind, hook_name in hookspecs.HOOK_FOR_KIND.items():
                for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                    if impl.plugin_name != info.name:
                        continue
                    specs: list[ComponentSpec] = []
                    impl.function(register=specs.append)
                    for spec in specs:
                        self._add(kind, spec, info)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported as a broken plugin
            self._mark_broken(info, exc)

    def _add(self, kind: str, spec: ComponentSpec, info: PluginInfo) -> None:
        spec.plugin = info.name
        spec.version = spec.version or info.version
        spec.first_party = info.distribution in FIRST_PARTY
        self.registries[kind].add(spec)
        info.components.append(f"{kind}:{spec.name}")

    def _mark_broken(self, info: PluginInfo, exc: BaseException) -> None:
        info.status = "broken"
        hint = exc.hint if isinstance(exc, OmnirlError) and exc.hint else ""
        info.error = f"{type(exc).__name__}: {exc}" + (f" {hint}" if hint else "")
        self.plugins[info.name] = info
        # drop whatever this plugin registered before it failed
        for registry in self.registries.values():
            registry._specs = [s for s in registry._specs if s.plugin != info.name]
        info.components.clear()
        if self.strict:
            raise PluginError(
                f"Plugin '{info.name}' ({info.module}) failed to load: {info.error}",
                details=[traceback.format_exception_only(type(exc), exc)[-1].strip()],
                hint="Fix or uninstall the plugin, or unset OMNIRL_STRICT_PLUGINS to skip broken plugins.",
            ) from exc

    # -- lookup --------------------------------------------------------------------------------
    @overload
    def resolve(self, kind: Literal["model"], name: str) -> ModelSpec: ...
    @overload
    def resolve(self, kind: Literal["algorithm"], name: str) -> AlgorithmSpec: ...
    @overload
    def resolve(self, kind: Literal["engine"], name: str) -> EngineSpec: ...
    @overload
    def resolve(self, kind: Literal["reward"], name: str) -> RewardSpec: ...
    @overload
    def resolve(self, kind: Literal["device"], name: str) -> DeviceSpec: ...
    @overload
    def resolve(self, kind: Literal["tracker"], name: str) -> TrackerSpec: ...
    @overload
    def resolve(self, kind: str, name: str) -> ComponentSpec: ...

    def resolve(self, kind: str, name: str) -> ComponentSpec:
        """The spec ``name`` (or ``plugin:name``) of ``kind``; its class is the kind's (the registry checks it)."""
        try:
            return self.registries[kind].resolve(name)
        except PluginError as err:
            broken = [p for p in self.plugins.values() if p.status == "broken"]
            if broken:
                err.details.append(
                    "Broken plugins (their components are unavailable): "
                    + "; ".join(f"{p.name}: {p.error}" for p in broken)
                )
            raise

    def broken(self) -> list[PluginInfo]:
        return [p for p in self.plugins.values() if p.status == "broken"]


_MANAGER: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, loaded on first use."""
    global _MANAGER
    if _MANAGER is None:
        manager = PluginManager()
        if _env_flag("OMNIRL_AUTOLOAD", True):
            manager.load_entry_points()
        manager.load_modules(_env_list("OMNIRL_PLUGINS"))
        _MANAGER = manager
    return _MANAGER


def set_plugin_manager(manager: PluginManager | None) -> None:
    """Replace (or with None, forget) the process-wide manager; tests use this for isolation."""
    global _MANAGER
    _MANAGER = manager
