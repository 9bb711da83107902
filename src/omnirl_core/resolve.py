"""From command-line inputs to a validated run: layers, component resolution, options, capability checks.
Nothing here touches a device or imports torch."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from omnirl_core.config import RunConfig, build_config, deep_merge, get_path, validate_options
from omnirl_core.errors import ConfigError, OmnirlError, PluginError
from omnirl_core.plugins import PluginManager
from omnirl_core.registry import AlgorithmSpec, ComponentSpec, DeviceSpec, EngineSpec, ModelSpec, RewardSpec

log = logging.getLogger("omnirl")


@dataclass
class ResolvedRun:
    config: RunConfig
    model: ModelSpec
    algorithm: AlgorithmSpec
    rollout_engine: EngineSpec
    train_engine: EngineSpec
    rewards: list[RewardSpec]
    device: DeviceSpec | None
    options: dict[str, BaseModel | None] = field(default_factory=dict)

    def dump(self) -> dict[str, Any]:
        """The resolved config with every plugin's options filled in with defaults (secrets redacted)."""
        data = self.config.model_dump(mode="json")
        for path, opts in self.options.items():
            if opts is not None:
                node: Any = data
                parts = path.split(".")
                for part in parts[:-1]:
                    node = node[int(part)] if isinstance(node, list) else node[part]
                node[parts[-1]] = opts.model_dump(mode="json")
        return data

    def lock(self, manager: PluginManager) -> list[dict[str, Any]]:
        used = {s.plugin for s in (self.model, self.algorithm, self.rollout_engine, self.train_engine,
                                    *self.rewards, *( [self.device] if self.device else []))}
        return [
            {"name": p.name, "distribution": p.distribution, "version": p.version, "module": p.module,
             "used": p.name in used}
            for p in sorted(manager.plugins.values(), key=lambda p: p.name) if p.status == "ok"
        ]


def _name_from(layers: list[dict[str, Any]], dotted: str) -> str | None:
    for layer in reversed(layers):
        try:
            value = get_path(layer, dotted)
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if value:
            return str(value)
    return None


def _defaults_fit_the_engine(manager: PluginManager, defaults: dict[str, Any], layers: list[dict[str, Any]],
                             merged: dict[str, Any]) -> dict[str, Any]:
    """The model's and algorithm's suggested rollout options were written for their suggested engine. When the
    user picks another rollout engine, the suggestions that engine has no option for are left out (e.g. the
    transformers engine's ``max_batch_size`` under vLLM); those it shares (sampling settings) stay. The user's
    own options are never filtered: a wrong one is still an error."""
    def find(tree: dict[str, Any], dotted: str) -> Any:
        try:
            return get_path(tree, dotted)
        except (KeyError, TypeError, IndexError):
            return None

    suggested = find(defaults, "rollout.engine")
    chosen = find(merged, "rollout.engine")
    options = find(defaults, "rollout.options")
    if not suggested or not chosen or chosen == suggested or not isinstance(options, dict):
        return merged
    try:
        config = manager.resolve("engine", chosen).load_config()
    except (OmnirlError, ImportError, AttributeError):  # reported where the engine is resolved and validated
        return merged
    fields = set(config.model_fields) if config is not None else set()
    kept = copy.deepcopy(defaults)
    kept["rollout"]["options"] = {k: v for k, v in options.items() if k in fields}
    out = kept
    for layer in layers:
        out = deep_merge(out, layer)
    return out


def resolve_run(manager: PluginManager, layers: list[dict[str, Any]], *, probe_device: bool = True) -> ResolvedRun:
    """``layers`` lowest first (recipe, flags, --set). Model and algorithm defaults slot in beneath them."""
    model_name = _name_from(layers, "model.name")
    algo_name = _name_from(layers, "algorithm.name")
    missing = [flag for flag, name in (("--model", model_name), ("--algo", algo_name)) if not name]
    if missing:
        raise ConfigError(
            f"Missing {' and '.join(missing)}.",
            hint="Example: omnirl train --model qwen-image --algo flowgrpo --preset tiny",
        )
    assert model_name is not None and algo_name is not None  # both given: checked above
    model_spec = manager.resolve("model", model_name)
    algo_spec = manager.resolve("algorithm", algo_name)

    preset = _name_from(layers, "model.preset")
    if preset is not None and preset not in model_spec.presets:
        raise ConfigError(
            f"Model '{model_spec.name}' has no preset '{preset}'.",
            hint=f"Presets of {model_spec.name}: {', '.join(model_spec.presets) or 'none'}.",
        )
    defaults = deep_merge(model_spec.recipe_defaults, algo_spec.recipe_defaults)
    if preset is not None:
        defaults = deep_merge(defaults, model_spec.preset_defaults.get(preset, {}))
        defaults = deep_merge(defaults, algo_spec.preset_defaults.get(preset, {}))
    merged = defaults
    for layer in layers:
        merged = deep_merge(merged, layer)
    merged = _defaults_fit_the_engine(manager, defaults, layers, merged)
    config = build_config(merged)

    # capabilities: refuse an incompatible pair with what is missing and who has it
    missing_caps = sorted(algo_spec.requires - model_spec.capabilities)
    if missing_caps:
        able = [m.name for m in manager.registries["model"]
                if isinstance(m, ModelSpec) and algo_spec.requires <= m.capabilities]
        fitting = [a.name for a in manager.registries["algorithm"]
                   if isinstance(a, AlgorithmSpec) and a.requires <= model_spec.capabilities]
        raise PluginError(
            f"Algorithm '{algo_spec.name}' cannot train model '{model_spec.name}': the model lacks "
            f"{', '.join(missing_caps)}.",
            details=[
                f"Models with what {algo_spec.name} needs: {', '.join(able) or 'none installed'}.",
                f"Algorithms that work with {model_spec.name}: {', '.join(fitting) or 'none installed'}.",
            ],
            hint="Pick a compatible pair (see `omnirl list models` and `omnirl list algos`).",
        )

    if config.model.lora.enabled and "lora" not in model_spec.capabilities:
        raise ConfigError(
            f"Model '{model_spec.name}' cannot train a LoRA adapter (its capabilities: "
            f"{', '.join(sorted(model_spec.capabilities))}).",
            hint="Set model.lora.enabled=false (full fine-tuning).",
        )
    rollout_spec = manager.resolve("engine", config.rollout.engine)
    train_spec = manager.resolve("engine", config.train.engine)
    spec: ComponentSpec  # each loop below narrows it to the specs it walks
    for spec, role in ((rollout_spec, "rollout"), (train_spec, "train")):
        if role not in spec.roles:
            raise PluginError(
                f"Engine '{spec.name}' cannot be the {role} engine (its roles: {', '.join(sorted(spec.roles))}).",
                hint=f"Set {role}.engine to an engine with the '{role}' role (see `omnirl list engines`).",
            )
    if not config.rewards:
        raise ConfigError("No reward given.", hint="Add --reward NAME (see `omnirl list rewards`).")
    reward_specs: list[RewardSpec] = []
    for entry in config.rewards:
        spec = manager.resolve("reward", entry.name)
        if "any" not in spec.modalities and not set(spec.modalities) & model_spec.capabilities:
            raise PluginError(
                f"Reward '{spec.name}' scores {' or '.join(spec.modalities)} outputs, but model "
                f"'{model_spec.name}' makes "
                f"{', '.join(sorted(model_spec.capabilities & {'image', 'video', 'audio', 'text'}))}.",
                hint="Pick a reward for this model's output (see `omnirl list rewards`).",
            )
        reward_specs.append(spec)
    names = [e.name for e in config.rewards]
    if len(set(names)) != len(names):
        raise ConfigError(f"A reward is listed twice: {names}.", hint="Give each reward once, with its weight.")
    for entry in config.rewards:
        if entry.weight == 0:
            log.warning("reward '%s' has weight 0: it is scored and logged but does not train the model",
                        entry.name)
        elif entry.weight < 0:
            log.warning("reward '%s' has a negative weight (%g): the model is trained to lower it (minimised); "
                        "give a positive weight to raise it", entry.name, entry.weight)
    if len(config.rewards) > 1 and sum(e.weight for e in config.rewards) == 0:
        log.warning("the reward weights sum to 0 (%s): rewards that move together cancel out",
                    ", ".join(f"{e.name}={e.weight:g}" for e in config.rewards))
    if config.rollout.group_size < algo_spec.min_group_size:
        raise ConfigError(
            f"rollout.group_size = {config.rollout.group_size}, but '{algo_spec.name}' compares samples within a "
            f"group and needs at least {algo_spec.min_group_size} (with 1, every advantage is 0: nothing trains).",
            hint=f"Set rollout.group_size to {algo_spec.min_group_size} or more (8-24 in the papers).",
        )

    apply_preset_to_rewards(config, reward_specs)
    options: dict[str, BaseModel | None] = {}
    problems: list[str] = []
    listings: dict[str, str] = {}  # the command that lists the options of each component with a problem
    checks = [
        ("model.options", config.model.options, model_spec),
        ("algorithm.options", config.algorithm.options, algo_spec),
        ("rollout.options", config.rollout.options, rollout_spec),
        ("train.options", config.train.options, train_spec),
        *((f"rewards.{i}.options", e.options, s) for i, (e, s) in enumerate(zip(config.rewards, reward_specs))),
    ]
    for path, opts, spec in checks:
        try:
            options[path] = validate_options(opts, spec.load_config(), path)
        except ConfigError as err:
            problems += err.details or [err.message]
            listings[spec.name] = f"`omnirl list {_LISTING.get(spec.kind, spec.kind + 's')} {spec.name} --options`"
        except ImportError as exc:
            raise PluginError(
                f"Plugin '{spec.plugin}' is installed but its {spec.kind} '{spec.name}' cannot be imported: {exc}",
                hint=f"Reinstall the plugin's dependencies (pip install {spec.plugin and 'omnirl-plugin-' + spec.plugin}).",
            ) from exc
    if problems:
        raise ConfigError(f"Invalid plugin options: {len(problems)} problem(s).", details=problems,
                          hint=f"See the options with {' and '.join(listings.values())}.")
    check_model_limits(config, model_spec, options["model.options"])

    device = resolve_device(manager, config.run.device) if probe_device else None
    if device is not None and config.model.dtype == "auto":
        from omnirl_core.precision import concrete_dtype

        config.model.dtype = concrete_dtype("auto", device.torch_device)  # type: ignore[assignment]
    if device is not None:
        for spec in (rollout_spec, train_spec):
            if device.torch_device not in spec.devices:
                raise PluginError(
                    f"Engine '{spec.name}' does not run on {device.name} (it supports {', '.join(sorted(spec.devices))}).",
                    hint="Pick another --device or engine.",
                )
    return ResolvedRun(config, model_spec, algo_spec, rollout_spec, train_spec, reward_specs, device, options)


_LISTING = {"model": "models", "algorithm": "algos", "engine": "engines", "reward": "rewards"}


def apply_preset_to_rewards(config: RunConfig, specs: list[RewardSpec]) -> list[str]:
    """``--preset P`` (``model.preset``) for every reward that has a preset of that name (a ``preset`` option that
    takes P: the learned rewards' ``tiny``, random-weight models of their architectures) and whose own ``preset``
    the config leaves unset: a tiny run asks for no real weights anywhere. Says so in the log; returns the paths
    set."""
    from pydantic import TypeAdapter, ValidationError

    preset = config.model.preset
    applied: list[str] = []
    if preset is None:
        return applied
    for i, (entry, spec) in enumerate(zip(config.rewards, specs)):
        try:
            cls = spec.load_config()
        except ImportError:
            continue  # reported where the options are validated
        field = getattr(cls, "model_fields", {}).get("preset") if cls is not None else None
        if field is None or "preset" in entry.options:
            continue
        try:
            TypeAdapter(field.annotation).validate_python(preset)
        except ValidationError:
            continue
        entry.options["preset"] = preset
        applied.append(f"rewards.{i}.options.preset")
        log.info("--preset %s applies to reward '%s' too (rewards.%d.options.preset=%s; set it to null for the "
                 "reward's real weights)", preset, spec.name, i, preset)
    return applied


def check_model_limits(config: RunConfig, spec: ModelSpec, options: BaseModel | None) -> None:
    """Refuse what the model cannot do before any weight loads: a guidance scale it cannot use, a size that is
    not a multiple of its factor, a frame count it cannot make (all problems at once)."""
    limits = spec.limits_for(config.model, options)
    r = config.rollout
    problems = []
    if limits.guidance == "none" and r.guidance_scale != 1.0:
        problems.append(f"rollout.guidance_scale = {r.guidance_scale:g}, but {spec.name} has no guidance "
                        "(neither an unconditional branch nor a guidance input): set it to 1.")
    m = limits.size_multiple
    if r.height % m or r.width % m:
        problems.append(f"rollout.height/width = {r.height}x{r.width}, but {spec.name} needs multiples of {m}.")
    if limits.max_size is not None and max(r.height, r.width) > limits.max_size:
        problems.append(f"rollout.height/width = {r.height}x{r.width}, but {spec.name}"
                        f"{f' (preset {config.model.preset})' if config.model.preset else ''} takes at most "
                        f"{limits.max_size} pixels a side (the range of its position embedding).")
    f = limits.frame_multiple
    if f is None and r.num_frames not in (None, 1):
        problems.append(f"rollout.num_frames = {r.num_frames}, but {spec.name} generates images: leave it unset.")
    if f is not None and (r.num_frames is None or (r.num_frames - 1) % f):
        problems.append(f"rollout.num_frames = {r.num_frames}, but {spec.name} makes videos of {f}k+1 frames.")
    if problems:
        raise ConfigError(f"The run asks for what model '{spec.name}' cannot do: {len(problems)} problem(s).",
                          details=problems, hint=f"Change these values (see `omnirl list models {spec.name}`).")


def resolve_device(manager: PluginManager, name: str) -> DeviceSpec:
    registry = manager.registries["device"]
    if name == "auto":
        available = [d for d in registry if isinstance(d, DeviceSpec) and d.available() > 0]
        if not available:
            raise PluginError("No device is available ('--device auto').",
                              hint="Install omnirl-plugin-cpu or pass --device explicitly.")
        return max(available, key=lambda d: d.priority)
    spec = manager.resolve("device", name)
    if spec.available() <= 0:
        raise PluginError(f"Device '{spec.name}' is not available on this machine.",
                          hint="Use --device auto or --device cpu.")
    return spec
