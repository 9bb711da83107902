"""``omnirl``: train, list plugins and components, show configs.

Thin: parses arguments, calls the core, prints. Importing it (and ``omnirl --help``) imports no torch.
Exit codes: 0 ok, 1 runtime failure, 2 usage or config error, 3 plugin resolution error.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import typer
import yaml

from omnirl_core import __version__, threads
from omnirl_core.errors import EXIT_RUNTIME, EXIT_USAGE, OmnirlError, RunInterrupted, UsageError

threads.apply_env()  # the OpenMP pool's size and wait policy: read once, when torch loads (after this)

app = typer.Typer(
    name="omnirl",
    help="RL post-training for diffusion and omni-modality models, built from plugins.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
plugins_app = typer.Typer(help="Installed plugins.", no_args_is_help=True)
config_app = typer.Typer(help="Configurations.", no_args_is_help=True)
app.add_typer(plugins_app, name="plugins")
app.add_typer(config_app, name="config")

STATE = {"debug": bool(os.environ.get("OMNIRL_DEBUG"))}
log = logging.getLogger("omnirl")


def _err(text: str) -> None:
    sys.stderr.write(text.rstrip("\n") + "\n")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"omnirl {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    if debug:
        STATE["debug"] = True
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


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


def _cell(value: Any) -> str:
    if isinstance(value, (list, tuple, set, frozenset)):
        return ", ".join(str(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


FormatOpt = typer.Option("table", "--format", help="table or json.")


def _check_format(fmt: str) -> None:
    if fmt not in ("table", "json"):
        raise UsageError(f"Unknown --format '{fmt}'.", hint="Use --format table or --format json.")


# -- listings -------------------------------------------------------------------------------------

@plugins_app.command("list")
def plugins_list(fmt: str = FormatOpt) -> None:
    """Every discovered plugin: ok, broken (with its error) or disabled."""
    _check_format(fmt)
    rows = [p.as_dict() for p in sorted(_manager().plugins.values(), key=lambda p: p.name)]
    if fmt == "json":
        typer.echo(json.dumps(rows, indent=2))
    else:
        _print_table(rows, ["name", "status", "distribution", "version", "components", "error"])


COLUMNS = {
    "model": ["name", "plugin", "capabilities", "presets", "description"],
    "algorithm": ["name", "plugin", "requires", "needs_logprobs", "needs_reference", "description"],
    "engine": ["name", "plugin", "roles", "devices", "description"],
    "reward": ["name", "plugin", "modality", "description"],
    "device": ["name", "plugin", "available", "torch_device", "backend", "ray_resource", "priority"],
}


def _options_schema(spec) -> list[dict[str, Any]]:
    cls = spec.load_config()
    if cls is None:
        return []
    rows = []
    for name, field in cls.model_fields.items():
        default = field.get_default(call_default_factory=True)
        rows.append({"option": name, "default": default if not hasattr(default, "model_dump") else
                     default.model_dump(), "description": field.description or ""})
    return rows


def _listing(kind: str, name: str | None, fmt: str, options: bool) -> None:
    _check_format(fmt)
    manager = _manager()
    if name:
        spec = manager.resolve(kind, name)
        info = spec.summary()
        if kind == "device":
            info["available"] = spec.available()
        if options:
            rows = _options_schema(spec)
            if fmt == "json":
                typer.echo(json.dumps({"name": spec.name, "options": rows}, indent=2, default=str))
            else:
                typer.echo(f"{kind} {spec.name} ({spec.plugin} {spec.version}): options")
                _print_table(rows, ["option", "default", "description"])
            return
        typer.echo(json.dumps(info, indent=2, default=str) if fmt == "json" else yaml.safe_dump(info, sort_keys=False))
        return
    rows = []
    for spec in manager.registries[kind]:
        row = spec.summary()
        if kind == "device":
            row["available"] = spec.available()
        rows.append(row)
    if fmt == "json":
        typer.echo(json.dumps(rows, indent=2, default=str))
    else:
        _print_table(rows, COLUMNS[kind])


NameArg = typer.Argument(None, help="Show one component.")
OptionsOpt = typer.Option(False, "--options", help="Print the component's options with defaults.")


@app.command("models")
def models_cmd(name: str | None = NameArg, fmt: str = FormatOpt, options: bool = OptionsOpt) -> None:
    """Installed models and their capabilities."""
    _listing("model", name, fmt, options)


@app.command("algos")
def algos_cmd(name: str | None = NameArg, fmt: str = FormatOpt, options: bool = OptionsOpt) -> None:
    """Installed algorithms and the model capabilities they need."""
    _listing("algorithm", name, fmt, options)


@app.command("engines")
def engines_cmd(name: str | None = NameArg, fmt: str = FormatOpt, options: bool = OptionsOpt) -> None:
    """Installed rollout and training engines."""
    _listing("engine", name, fmt, options)


@app.command("rewards")
def rewards_cmd(name: str | None = NameArg, fmt: str = FormatOpt, options: bool = OptionsOpt) -> None:
    """Installed rewards."""
    _listing("reward", name, fmt, options)


@app.command("devices")
def devices_cmd(name: str | None = NameArg, fmt: str = FormatOpt, options: bool = OptionsOpt) -> None:
    """Hardware plugins and whether each device is available here."""
    _listing("device", name, fmt, options)


# -- config and train -----------------------------------------------------------------------------

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
                 executor=None, ray_address=None, qualified=frozenset()) -> list[dict]:
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
    if run:
        flags["run"] = run
    layers.append(flags)
    if overrides:
        layers.append(parse_set(overrides))
    return layers


ModelOpt = typer.Option(None, "--model", "-m", help="Model name (see `omnirl models`).")
AlgoOpt = typer.Option(None, "--algo", "-a", help="Algorithm name (see `omnirl algos`).")
PresetOpt = typer.Option(None, "--preset", help="Model preset, e.g. 'tiny' (random weights, built locally).")
RewardOpt = typer.Option(None, "--reward", "-r", help="NAME[:WEIGHT], repeatable.")
RecipeOpt = typer.Option(None, "--recipe", help="Recipe YAML.")
SetOpt = typer.Option(None, "--set", help="KEY=VALUE override, repeatable (e.g. train.lr=3e-4).")


@config_app.command("show")
def config_show(
    model: str | None = ModelOpt,
    algo: str | None = AlgoOpt,
    preset: str | None = PresetOpt,
    reward: list[str] | None = RewardOpt,
    recipe: str | None = RecipeOpt,
    overrides: list[str] | None = SetOpt,
    fmt: str = typer.Option("yaml", "--format", help="yaml or json."),
) -> None:
    """The resolved config (every key, with plugin options and defaults; secrets redacted)."""
    from omnirl_core.config import RunConfig
    from omnirl_core.resolve import resolve_run

    layers = build_layers(model, algo, preset, reward, recipe, overrides, None, None, None, None)
    if not (model or algo or recipe or overrides):
        data = RunConfig().model_dump(mode="json")
    else:
        data = resolve_run(_manager(), layers, probe_device=False).dump()
    typer.echo(json.dumps(data, indent=2) if fmt == "json" else yaml.safe_dump(data, sort_keys=False))


def _run_dir(resolved, explicit: bool) -> Path:
    cfg = resolved.config
    if cfg.run.output_dir:
        return Path(cfg.run.output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{resolved.model.name}-{resolved.algorithm.name}-{stamp}"


@app.command()
def train(
    model: str | None = ModelOpt,
    algo: str | None = AlgoOpt,
    preset: str | None = PresetOpt,
    reward: list[str] | None = RewardOpt,
    recipe: str | None = RecipeOpt,
    overrides: list[str] | None = SetOpt,
    output_dir: str | None = typer.Option(None, "--output-dir", "-o", help="Run directory (resumes if it holds "
                                             "this run)."),
    steps: int | None = typer.Option(None, "--steps", help="Training steps."),
    device: str | None = typer.Option(None, "--device", help="auto, cpu, cuda, ..."),
    seed: int | None = typer.Option(None, "--seed", help="Run seed."),
    executor: str | None = typer.Option(None, "--executor", help="inline (this process) or ray (Ray actors)."),
    ray_address: str | None = typer.Option(None, "--ray-address", help="Ray cluster address (with --executor "
                                              "ray); default: start a local Ray instance."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Resolve and validate, print the plan, touch no device."),
) -> None:
    """Train a model with an algorithm and rewards."""
    from omnirl_core.resolve import resolve_run
    from omnirl_core.tracking import RunDir

    manager = _manager()
    layers = build_layers(model, algo, preset, reward, recipe, overrides, output_dir, steps, device, seed,
                          executor, ray_address,
                          qualified={s.qualified_name for s in manager.registries["reward"]})
    resolved = resolve_run(manager, layers, probe_device=not dry_run)
    cfg = resolved.config
    run_path = _run_dir(resolved, bool(output_dir))
    dump = resolved.dump()
    dump["run"]["output_dir"] = str(run_path)
    run_dir = RunDir(run_path)
    one_sided = run_dir.check(dump)
    if one_sided:
        _err(f"note: the run in '{run_path}' was saved by a version with other options; resuming with:\n"
             + "\n".join(f"  {d}" for d in one_sided[:10]))
    if dry_run:
        plan = {
            "run_dir": str(run_path),
            "model": f"{resolved.model.qualified_name} (preset {cfg.model.preset or '-'}, path "
                     f"{cfg.model.path or resolved.model.default_path or '-'})",
            "algorithm": resolved.algorithm.qualified_name,
            "rollout_engine": resolved.rollout_engine.qualified_name,
            "train_engine": resolved.train_engine.qualified_name,
            "rewards": [f"{e.name} x{e.weight}{'' if e.required else ' (optional)'}" for e in cfg.rewards],
            "device": cfg.run.device,
            "executor": cfg.run.executor,
            "samples_per_step": cfg.rollout.prompts_per_step * cfg.rollout.group_size,
            "steps": cfg.run.steps,
            "config": dump,
        }
        typer.echo(yaml.safe_dump(plan, sort_keys=False))
        return
    resuming = run_dir.claim(dump, resolved.lock(manager))
    _err(f"omnirl: {'resuming' if resuming else 'starting'} run in {run_path} on {resolved.device.name}")
    _train(resolved, run_path)


def _train(resolved, run_path: Path) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from omnirl_core.controller import Controller

    cfg = resolved.config
    progress = Progress(
        TextColumn("step {task.completed:>4.0f}/{task.total:.0f}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=False,
        refresh_per_second=4,
    )
    task = progress.add_task("train", total=cfg.run.steps, info="setting up")

    def on_step(record: dict[str, Any]) -> None:
        info = (f"reward {record['reward/mean']:.4f}  loss {record.get('loss', float('nan')):+.4f}  "
                f"{record['time/step_s']:.2f}s/step")
        progress.update(task, completed=record["step"], info=info)

    controller = Controller(resolved, run_path, on_step=on_step)
    try:
        with progress:
            progress.update(task, completed=controller.start_step - 1)
            summary = controller.run()
    except KeyboardInterrupt as exc:  # typer would turn it into a bare exit code
        raise RunInterrupted(
            f"interrupted: {run_path} holds every finished step that was saved "
            f"({_saved_steps(run_path)}).", exit_code=getattr(exc, "exit_code", 130),
            hint="Rerun the same command to resume.") from None
    records = controller.run_dir.read_metrics()
    if records:
        last = records[-1]
        _err(f"omnirl: done: {summary['steps']} steps, last reward/mean {last['reward/mean']:.4f}; "
             f"run directory {run_path}")


def _saved_steps(run_path: Path) -> str:
    from omnirl_core.checkpoint import latest_checkpoint

    latest = latest_checkpoint(run_path)
    return f"latest checkpoint {latest.name}" if latest else "no checkpoint yet: a rerun starts over"


def run() -> None:
    """Console-script entry: maps errors to exit codes; tracebacks only with --debug."""
    try:
        code = app(standalone_mode=False)
        if code == 130:  # typer's answer to a KeyboardInterrupt outside a run
            _err("omnirl: interrupted")
        if isinstance(code, int) and code:
            sys.exit(code)
    except OmnirlError as err:
        if STATE["debug"]:
            raise
        _err(f"Error: {err.render()}")
        sys.exit(err.exit_code)
    except KeyboardInterrupt as exc:
        _err("omnirl: interrupted")
        sys.exit(getattr(exc, "exit_code", 130))
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:
        # typer's (vendored) click: usage errors know how to show themselves
        if type(exc).__name__ == "NoArgsIsHelpError":
            sys.exit(EXIT_USAGE)  # the help text is already printed
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):
            exc.show()
            sys.exit(EXIT_USAGE)
        if type(exc).__name__ == "Abort":
            sys.exit(EXIT_RUNTIME)
        if STATE["debug"]:
            raise
        _err(f"Error: {type(exc).__name__}: {exc}\nRerun with --debug for the traceback.")
        sys.exit(EXIT_RUNTIME)


if __name__ == "__main__":
    run()
