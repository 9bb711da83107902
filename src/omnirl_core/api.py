"""omnirl from Python: the functions the CLI's commands call, for a user who drives runs from code.

    from omnirl_core import api

    config = {"model": {"name": "qwen-image", "preset": "tiny"}, "algorithm": {"name": "flowgrpo"},
              "run": {"steps": 20, "output_dir": "runs/tiny"}}
    run_dir = api.train(config)                       # the whole RL loop; rerun to resume
    report = api.evaluate(run_dir)                    # held-out prompts, fixed seeds, every reward
    print(report.results[0].summary()["reward/total"]["mean"])
    print(api.plan(config, device_memory="80GiB").table())

A config is what a recipe YAML holds: a dict of config values, a path to a recipe, or a list of such layers
(lowest first), as ``omnirl train --recipe R --set ...`` stacks them. Plugins are the installed ones
(``omnirl_core.plugins.get_plugin_manager``) unless a ``manager`` is given. Errors are ``omnirl_core.errors``
exceptions: ``err.render()`` is what the CLI prints, ``err.exit_code`` its exit code.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnirl_core.config import RunConfig
    from omnirl_core.loop.controller import Controller
    from omnirl_core.loop.evaluation import EvalResult
    from omnirl_core.planning.planner import MemoryPlan
    from omnirl_core.plugins import PluginManager
    from omnirl_core.resolve import ResolvedRun

Config = Mapping[str, Any] | str | Path | Sequence[Mapping[str, Any] | str | Path]
"""Config values (a dict), a recipe YAML's path, or a list of either, lowest layer first."""


def config_layers(config: Config) -> list[dict[str, Any]]:
    """``config`` as the list of layers ``resolve_run`` merges (recipes read from their files)."""
    from omnirl_core.config import load_recipe

    items = [config] if isinstance(config, (Mapping, str, Path)) else list(config)
    return [load_recipe(str(item)) if isinstance(item, (str, Path)) else dict(item) for item in items]


def _manager(manager: PluginManager | None) -> PluginManager:
    from omnirl_core.plugins import get_plugin_manager

    return manager if manager is not None else get_plugin_manager()


def resolve(config: Config, *, manager: PluginManager | None = None, probe_device: bool = True) -> ResolvedRun:
    """The run ``config`` describes, every component found and every option validated (``ConfigError`` lists all
    problems with their paths; ``PluginError`` names a missing or broken plugin)."""
    from omnirl_core.resolve import resolve_run

    return resolve_run(_manager(manager), config_layers(config), probe_device=probe_device)


def train(config: Config | ResolvedRun, *, manager: PluginManager | None = None,
          on_step: Callable[[dict[str, Any]], None] | None = None,
          on_start: Callable[[Controller], None] | None = None,
          on_claim: Callable[[Path, bool], None] | None = None) -> Path:
    """Run (or resume) the training ``config`` describes; returns its run directory. The prompt data and the memory
    plan are checked first, as ``omnirl train`` checks them. ``on_step(row)`` gets each step's metrics row;
    ``on_claim(run_dir, resuming)`` is called once the run directory is locked for this run, before the models
    load; ``on_start(controller)`` once the controller is built (``controller.start_step``: 1, or the step after the
    checkpoint it resumed from). Ctrl-C ends it as the CLI's does (``KeyboardInterrupt``, every finished step
    saved)."""
    from omnirl_core.loop.controller import Controller
    from omnirl_core.loop.launch import Launch
    from omnirl_core.resolve import ResolvedRun

    manager = _manager(manager)
    resolved = config if isinstance(config, ResolvedRun) else resolve(config, manager=manager)
    if resolved.config.run.executor == "inline":
        _check_engine_environment(resolved)
    launch = Launch.prepare(manager, resolved, dry_run=False)
    resuming = launch.claim(manager)
    if on_claim is not None:
        on_claim(launch.run_path, resuming)
    controller = Controller(resolved, launch.run_path, on_step=on_step, data=launch.data)
    if on_start is not None:
        on_start(controller)
    controller.run()
    return launch.run_path


def _check_engine_environment(resolved: ResolvedRun) -> None:
    """An inline run builds its train engine in this process: refuse an engine that needs another environment."""
    from omnirl_core.errors import UsageError
    from omnirl_core.serving.envs import worker_environment

    env = worker_environment(resolved.train_engine)
    if env is not None:
        raise UsageError(
            f"Train engine '{resolved.train_engine.name}' runs in its own environment '{env.name}', not in this "
            "interpreter's.",
            hint=f"Use `omnirl train` (an inline run continues in that environment), run.executor=ray (the train "
            f"workers run there), or call this from that environment's python (`omnirl env path {env.name}`).",
        )


@dataclass
class EvalReport:
    """What ``evaluate`` measured: one ``EvalResult`` per model evaluated (``base`` and / or ``trained``), the
    paired comparison when both were, and the ``results.json`` written."""

    results: list[EvalResult]
    comparison: dict[str, dict[str, float]] | None
    path: Path
    described: str
    """The prompts, in words (their source, split and count)."""
    checkpoint: str | None
    """The weights asked for (a checkpoint or LoRA directory), or None for the base model alone."""
    weights: str | None
    """What was loaded for ``trained`` (a checkpoint's evaluation weights, its trained weights, a LoRA), or None."""


def evaluate(run_dir: str | Path | None = None, *, config: Config | None = None,
             manager: PluginManager | None = None, checkpoint: str | None = None, lora: str | None = None,
             base: bool = False, trained_weights: bool = False, compare: str | None = None,
             prompts: str | None = None, split: str = "test", samples: int = 4, max_prompts: int | None = None,
             seed: int = 0, output_dir: str | Path | None = None,
             on_start: Callable[[str, RunConfig], None] | None = None) -> EvalReport:
    """Evaluate a model on held-out prompts with fixed seeds, the deterministic (ODE) sampler and every reward of
    the run: ``run_dir``'s config and its latest checkpoint (or ``checkpoint``), a ``lora`` directory, or the base
    model (``base``, or no weights). ``config`` adds or replaces config values (a model, rewards); ``compare='base'``
    evaluates the base model too, side by side. Writes ``eval/<step>/results.json`` under ``output_dir`` (default:
    the run directory). ``on_start(described, config)`` is told what is about to be evaluated, and how."""
    from omnirl_core.errors import UsageError
    from omnirl_core.loop import evaluation as ev

    if compare not in (None, "base"):
        raise UsageError(f"Unknown compare '{compare}'.", hint="Use compare='base' (--compare base).")
    manager = _manager(manager)
    items = [] if config is None else [config] if isinstance(config, (Mapping, str, Path)) else list(config)
    layers = config_layers(items)
    # a recipe, or a model name, picks the model (else the run's); an algorithm name, the algorithm
    named_model = any(isinstance(item, (str, Path)) for item in items) or \
        any((layer.get("model") or {}).get("name") for layer in layers)
    named_algo = any((layer.get("algorithm") or {}).get("name") for layer in layers)
    run_path = Path(run_dir) if run_dir else None
    resolved = ev.resolve_for_eval(manager, layers, run_path, named_model, named_algo)
    weights = ev.weights_to_load(run_path, checkpoint, lora, base)
    if compare and weights is None:
        raise UsageError("--compare base needs trained weights to compare with.",
                         hint="Give a run directory (or --checkpoint / --lora).")
    records, described = ev.eval_records(resolved, prompts, split, max_prompts)
    if on_start is not None:
        on_start(described, resolved.config)
    cfg = resolved.config
    evaluator = ev.Evaluator(resolved)
    results = []
    if weights is None or compare == "base":
        results.append(ev.evaluate(evaluator.generate, records, cfg, samples, seed, "base",
                                   displays=evaluator.displays))
    if weights is not None:
        evaluator.load(weights, trained=trained_weights)
        results.append(ev.evaluate(evaluator.generate, records, cfg, samples, seed, "trained",
                                   displays=evaluator.displays))
    comparison = ev.compare(results[0], results[1]) if len(results) == 2 else None
    step = ev.checkpoint_step(weights)
    root = Path(output_dir) if output_dir else run_path if run_path else ev.default_eval_dir(resolved)
    name = f"step-{step:06d}" if weights is None or step or checkpoint else f"lora-{weights.name}"
    settings = ev.eval_settings(cfg, step=step, checkpoint=str(weights) if weights else None,
                                weights=evaluator.loaded, during_training=False, prompts=described,
                                test_prompts=len(records), samples=samples, seed=seed)
    path = ev.write_results(root / "eval" / name, results, settings, comparison, samples)
    return EvalReport(results, comparison, path, described, str(weights) if weights is not None else None,
                      evaluator.loaded if weights is not None else None)


def plan(config: Config | ResolvedRun, *, manager: PluginManager | None = None,
         device_memory: str | int | None = None) -> MemoryPlan:
    """The memory the run needs per device and worker group, from the architecture it loads built on the ``meta``
    device (no weights, no download), against ``device_memory`` (bytes, or e.g. ``"80GiB"``; default: the memory
    of the device the run would use here, the CPU's available RAM or the first GPU's). ``plan.fits`` is the verdict;
    ``plan.table()`` what ``omnirl plan`` prints."""
    from omnirl_core.errors import OmnirlError
    from omnirl_core.planning.memory import device_memory as probe
    from omnirl_core.planning.memory import with_device_dtype
    from omnirl_core.planning.planner import (
        auto_micro_batch,
        load_sizing,
        parse_bytes,
        plan_memory,
        train_micro_batch,
    )
    from omnirl_core.resolve import ResolvedRun, resolve_device

    manager = _manager(manager)
    resolved = config if isinstance(config, ResolvedRun) else resolve(config, manager=manager, probe_device=False)
    try:
        kind: str | None = resolve_device(manager, resolved.config.run.device).torch_device
    except OmnirlError:  # the run's device is not on this machine: plan without probing it
        kind = None
    if device_memory is None:
        memory, source = probe(kind)
    else:
        memory = device_memory if isinstance(device_memory, int) else parse_bytes(device_memory)
        source = ""
    resolved = with_device_dtype(resolved, kind)
    sizing = load_sizing(resolved)
    micro = auto_micro_batch(resolved, sizing, memory, kind)
    if micro is not None and micro < train_micro_batch(resolved.config):
        # train.micro_batch_size: auto, and the whole share would not fit: plan what the run will do (as many
        # transitions per call as fit, check_run_memory's choice), on a copy of the caller's config
        resolved = copy.copy(resolved)
        resolved.config = resolved.config.model_copy(deep=True)
        resolved.config.train.micro_batch_size = micro
    return plan_memory(resolved, memory, sizing, device_type=kind, memory_source=source)
