"""What the CLI's commands share: the run flags (declared once, read the same in every command), the plugin
manager, tables and messages. The command modules import this one, never each other."""

from __future__ import annotations

import inspect
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

from omnirl_core.errors import UsageError

if TYPE_CHECKING:
    from omnirl_core.plugins import PluginManager


def _err(text: str) -> None:
    sys.stderr.write(text.rstrip("\n") + "\n")


def _manager():
    from omnirl_core.plugins import get_plugin_manager

    return get_plugin_manager()


def _print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(show_lines=False)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*[_cell(row.get(c, "")) for c in columns])
    Console(width=200).print(table)


def _cell(value: object) -> str:
    if isinstance(value, (list, tuple, set, frozenset)):
        return ", ".join(str(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


FormatOpt = typer.Option("table", "--format", help="table or json.")


def _check_format(fmt: str) -> None:
    if fmt not in ("table", "json"):
        raise UsageError(f"Unknown --format '{fmt}'.", hint="Use --format table or --format json.")


def parse_reward(text: str, qualified: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
    """NAME, NAME:WEIGHT, PLUGIN:NAME or PLUGIN:NAME:WEIGHT (``qualified``: the installed rewards'
    PLUGIN:NAME names, which tell a qualified name from a weight that is not a number)."""
    import math

    if not text.strip():
        raise UsageError("Empty --reward.", hint="Use --reward NAME or --reward NAME:WEIGHT.")
    head, sep, tail = text.rpartition(":")
    if not sep or text in qualified:
        return {"name": text}  # NAME or PLUGIN:NAME
    if not _is_number(tail):
        raise UsageError(f"--reward {text}: the weight '{tail}' is not a number.",
                         hint="Use --reward NAME:WEIGHT with a number (e.g. jpeg:0.5), or PLUGIN:NAME for a "
                         "reward of one plugin.")
    weight = float(tail)
    if not math.isfinite(weight):
        raise UsageError(f"--reward {text}: the weight must be a finite number, not {tail}.",
                         hint="Use --reward NAME:WEIGHT with a finite weight (e.g. color:1.0).")
    return {"name": head, "weight": weight}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def build_layers(model, algo, preset, rewards, recipe, overrides, output_dir, steps, device, seed,
                 executor=None, ray_address=None, qualified=frozenset(), trackers=None) -> list[dict]:
    from omnirl_core.config import load_recipe, parse_set

    layers = []
    if recipe:
        layers.append(load_recipe(recipe))
    flags: dict[str, Any] = {}
    if model:
        flags.setdefault("model", {})["name"] = model
    if preset:
        flags.setdefault("model", {})["preset"] = preset
    if algo:
        flags.setdefault("algorithm", {})["name"] = algo
    if rewards:
        flags["rewards"] = [parse_reward(r, qualified) for r in rewards]
    run: dict[str, Any] = {}
    if output_dir:
        run["output_dir"] = output_dir
    if steps is not None:
        run["steps"] = steps
    if device:
        run["device"] = device
    if seed is not None:
        run["seed"] = seed
    if executor:
        run["executor"] = executor
    if ray_address:
        run["ray_address"] = ray_address
    if trackers:
        run["trackers"] = [{"name": t} for t in trackers]
    if run:
        flags["run"] = run
    layers.append(flags)
    if overrides:
        layers.append(parse_set(overrides))
    return layers


ModelOpt = typer.Option(None, "--model", "-m", help="Model name (see `omnirl list models`).")
AlgoOpt = typer.Option(None, "--algo", "-a", help="Algorithm name (see `omnirl list algos`).")
PresetOpt = typer.Option(None, "--preset", help="Model preset, e.g. 'tiny' (random weights, built locally).")
RewardOpt = typer.Option(None, "--reward", "-r", help="NAME[:WEIGHT], repeatable.")
RecipeOpt = typer.Option(None, "--recipe", help="Recipe YAML.")
SetOpt = typer.Option(None, "--set", help="KEY=VALUE override, repeatable (e.g. train.lr=3e-4).")
TrackerOpt = typer.Option(None, "--tracker", help="Experiment tracker (tensorboard, wandb, ...), repeatable; "
                          "options with --set run.trackers.N.options.KEY=VALUE.")


OutputDirOpt = typer.Option(None, "--output-dir", "-o", help="Run directory (resumes if it holds this run).")
StepsOpt = typer.Option(None, "--steps", help="Training steps.")
DeviceOpt = typer.Option(None, "--device", help="auto, cpu, cuda, ...")
SeedOpt = typer.Option(None, "--seed", help="Run seed.")
ExecutorOpt = typer.Option(None, "--executor", help="inline (this process) or ray (Ray actors).")
RayAddressOpt = typer.Option(None, "--ray-address", help="Ray cluster to join with --executor ray: auto (this "
                             "machine's cluster) or HOST:PORT (the head's GCS); default: RAY_ADDRESS if set, else a "
                             "local Ray instance. Placement over its nodes: run.ray_pools (docs/CLUSTER.md).")
DryRunOpt = typer.Option(False, "--dry-run", help="Resolve and validate, print the plan, touch no device.")


@dataclass
class RunFlags:
    """The flags that make a run's config layers (``build_layers``), as one value: what ``run_flags`` passes."""

    model: str | None = None
    algo: str | None = None
    preset: str | None = None
    reward: list[str] | None = None
    recipe: str | None = None
    overrides: list[str] | None = None
    output_dir: str | None = None
    steps: int | None = None
    device: str | None = None
    seed: int | None = None
    executor: str | None = None
    ray_address: str | None = None
    tracker: list[str] | None = None

    def layers(self, manager: PluginManager) -> list[dict]:
        return build_layers(self.model, self.algo, self.preset, self.reward, self.recipe, self.overrides,
                            self.output_dir, self.steps, self.device, self.seed, self.executor, self.ray_address,
                            qualified={s.qualified_name for s in manager.registries["reward"]},
                            trackers=self.tracker)


RUN_FLAGS: dict[str, tuple[Any, Any]] = {
    "model": (str | None, ModelOpt), "algo": (str | None, AlgoOpt), "preset": (str | None, PresetOpt),
    "reward": (list[str] | None, RewardOpt), "recipe": (str | None, RecipeOpt), "overrides": (list[str] | None, SetOpt),
    "output_dir": (str | None, OutputDirOpt), "steps": (int | None, StepsOpt), "device": (str | None, DeviceOpt),
    "seed": (int | None, SeedOpt), "executor": (str | None, ExecutorOpt), "ray_address": (str | None, RayAddressOpt),
    "tracker": (list[str] | None, TrackerOpt),
}
"""Every ``RunFlags`` field: its type and its option."""


def run_flags(*names: str, **options: object) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A command decorator: the command takes the run flags ``names`` (all of them when none is named;
    ``options`` gives one of them another ``typer.Option``) ahead of its own parameters and gets them as its first
    argument, one ``RunFlags``. Declared once, a flag reads the same in every command that takes it."""
    chosen = names or tuple(RUN_FLAGS)
    keyword = inspect.Parameter.KEYWORD_ONLY

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(command, localns={"RunFlags": RunFlags})
        own = list(inspect.signature(command).parameters.values())[1:]
        flags = [inspect.Parameter(n, keyword, default=options.get(n, RUN_FLAGS[n][1]), annotation=RUN_FLAGS[n][0])
                 for n in chosen]

        def with_flags(**kwargs):  # typer reads the signature below, with evaluated types, not annotations
            return command(RunFlags(**{n: kwargs.pop(n) for n in chosen}), **kwargs)

        for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(with_flags, attribute, getattr(command, attribute))
        with_flags.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            flags + [p.replace(kind=keyword, annotation=hints.get(p.name, p.annotation)) for p in own])
        return with_flags

    return decorate


