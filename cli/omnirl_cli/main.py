"""``omnirl``: train, list plugins and components, show configs.

Thin: parses arguments, calls the core, prints. Importing it (and ``omnirl --help``) imports no torch.
Exit codes: 0 ok, 1 runtime failure, 2 usage or config error, 3 plugin resolution error.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
import yaml

from omnirl_core.errors import EXIT_RUNTIME, EXIT_USAGE, OmnirlError, RunInterrupted, UsageError
from omnirl_core.host import threads
from omnirl_core.project import __version__

if TYPE_CHECKING:
    from omnirl_core.resolve import ResolvedRun

from omnirl_cli.common import (
    DryRunOpt,
    FormatOpt,
    RunFlags,
    _check_format,
    _err,
    _manager,
    _print_table,
    build_layers,
    run_flags,
)

threads.apply_env()  # the OpenMP pool's size and wait policy: read once, when torch loads (after this)

app = typer.Typer(
    name="omnirl",
    help="RL post-training for diffusion and omni-modality models, built from plugins.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Configurations.", no_args_is_help=True)
app.add_typer(config_app, name="config")

STATE = {"debug": bool(os.environ.get("OMNIRL_DEBUG"))}
log = logging.getLogger("omnirl")


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


# -- listings -------------------------------------------------------------------------------------

COLUMNS = {
    "model": ["name", "plugin", "capabilities", "presets", "description"],
    "algorithm": ["name", "plugin", "requires", "needs_reference", "description"],
    "engine": ["name", "plugin", "roles", "devices", "description"],
    "reward": ["name", "plugin", "modality", "description"],
    "device": ["name", "plugin", "available", "torch_device", "backend", "ray_resource", "priority"],
    "tracker": ["name", "plugin", "requires", "description"],
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
KINDS = {"plugins": "plugin", "models": "model", "algos": "algorithm", "algorithms": "algorithm",
         "engines": "engine", "rewards": "reward", "devices": "device", "trackers": "tracker"}
KINDS.update({v: v for v in list(KINDS.values())} | {"algo": "algorithm"})


@app.command("list")
def list_cmd(
    kind: str = typer.Argument("plugins", help="plugins, models, algos, engines, rewards, devices or trackers."),
    name: str | None = NameArg,
    fmt: str = FormatOpt,
    options: bool = OptionsOpt,
) -> None:
    """Installed plugins (ok, broken with its error, or disabled), or the components of one kind: models and
    their capabilities, algorithms and what they need, engines, rewards, devices (available here?), trackers.
    With NAME: one component; --options: its options with defaults."""
    _check_format(fmt)
    if kind not in KINDS:
        raise UsageError(f"Unknown kind '{kind}'.", hint="Choose one of: plugins, models, algos, engines, rewards, "
                         "devices, trackers.")
    if KINDS[kind] != "plugin":
        _listing(KINDS[kind], name, fmt, options)
        return
    plugins = sorted(_manager().plugins.values(), key=lambda p: p.name)
    rows = [p.as_dict() for p in plugins if name is None or p.name == name]
    if name is not None and not rows:
        raise UsageError(f"No plugin named '{name}'.", hint="See `omnirl list plugins`.")
    if fmt == "json":
        typer.echo(json.dumps(rows, indent=2))
    else:
        _print_table(rows, ["name", "status", "distribution", "version", "components", "error"])


# -- train ----------------------------------------------------------------------------------------

@config_app.command("show")
@run_flags()
def config_show(
    flags: RunFlags,
    dry_run: bool = typer.Option(False, "--dry-run", help="Accepted so that a train command pastes as is."),
    fmt: str = typer.Option("yaml", "--format", help="yaml or json."),
) -> None:
    """The resolved config (every key, with plugin options and defaults; secrets redacted). Takes every flag
    `omnirl train` takes."""
    from omnirl_core.config import RunConfig
    from omnirl_core.resolve import resolve_run

    manager = _manager()
    layers = flags.layers(manager)
    if not (flags.model or flags.algo or flags.recipe or flags.overrides):
        data = RunConfig().model_dump(mode="json")
    else:
        data = resolve_run(manager, layers, probe_device=False).dump()
    typer.echo(json.dumps(data, indent=2) if fmt == "json" else yaml.safe_dump(data, sort_keys=False))


AllowRecipeEnvsOpt = typer.Option(
    False, "--allow-recipe-environments", help="Honour the Ray runtime environments a recipe sets "
    "(run.ray_runtime_envs: another interpreter, packages pip or uv installs, environment variables). They run "
    "commands of the recipe's choosing, so without this flag such a recipe is refused under --executor ray. Your "
    "own --set values need no flag.")


def check_recipe_environments(recipe: str | None, layers: list[dict], resolved: ResolvedRun,
                              allowed: bool) -> None:
    """A recipe's ``run.ray_runtime_envs`` are honoured only with ``--allow-recipe-environments``: a
    ``py_executable``, a ``pip`` / ``uv`` list or ``env_vars`` (``LD_PRELOAD``) run what the recipe's author chose, on
    this machine, under Ray. Refused with exit 2 otherwise; values from ``--set`` are the user's own."""
    envs = ((layers[0].get("run") or {}).get("ray_runtime_envs") or {}) if recipe and layers else {}
    envs = {group: spec for group, spec in envs.items() if spec} if isinstance(envs, dict) else {}
    if not envs or allowed or resolved.config.run.executor != "ray":
        return
    raise UsageError(
        f"The recipe {recipe} sets Ray runtime environments, which run commands of its choosing under --executor "
        "ray; they are honoured only with --allow-recipe-environments.",
        details=[f"  run.ray_runtime_envs.{group}: {_shown_env(spec)}" for group, spec in envs.items()],
        hint="Read them in the recipe; if you trust it, rerun with --allow-recipe-environments (or remove them, or "
        "give your own with --set run.ray_runtime_envs.GROUP.KEY=VALUE).")


def _shown_env(spec: object) -> str:
    """A runtime environment for a message: environment variables by name only (values may be secrets)."""
    if not isinstance(spec, dict):
        return repr(spec)
    shown = {k: (sorted(v) if k == "env_vars" and isinstance(v, dict) else v) for k, v in spec.items()}
    return json.dumps(shown, default=str)


@app.command()
@run_flags()
def train(flags: RunFlags, dry_run: bool = DryRunOpt, allow_recipe_environments: bool = AllowRecipeEnvsOpt) -> None:
    """Train a model with an algorithm and rewards."""
    from omnirl_core.loop.launch import Launch
    from omnirl_core.resolve import resolve_run

    manager = _manager()
    layers = flags.layers(manager)
    resolved = resolve_run(manager, layers, probe_device=not dry_run)
    check_recipe_environments(flags.recipe, layers, resolved, allow_recipe_environments)
    if not dry_run and resolved.config.run.executor == "inline":
        _continue_in_engine_environment(resolved)
    if dry_run:
        launch = Launch.prepare(manager, resolved, dry_run=True)
        if launch.data_problem:
            _err(f"warning: {launch.data_problem}")
        typer.echo(yaml.safe_dump(launch.plan(), sort_keys=False))
        if launch.memory is not None:  # checked in prepare, as the run checks it: exit 2 when it does not fit
            typer.echo("memory_plan: |\n" + "\n".join("  " + line for line in launch.memory.table().splitlines()))
        return
    _train(resolved, manager)


def _continue_in_engine_environment(resolved: ResolvedRun) -> None:
    """A train engine that runs in an environment of its own: the inline run continues there, the same
    command in that environment's interpreter (this process replaced: signals, exit code and output are the
    run's). Returns where this interpreter will do. With --executor ray only the train workers go there."""
    from omnirl_core.serving.envs import environment_python, worker_environment

    env = worker_environment(resolved.train_engine)
    if env is None:
        return
    python = environment_python(env)  # exit 2 naming `omnirl env build` when not built; plugins kept in step
    _err(f"omnirl: train engine '{resolved.train_engine.name}' runs in its own environment '{env.name}': "
         f"continuing there ({python})")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(str(python), [str(python), "-m", "omnirl_cli", *sys.argv[1:]], {**os.environ, **env.env})


def _train(resolved: ResolvedRun, manager: Any) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from omnirl_core.api import train as run_training

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
    started: dict[str, Any] = {}

    def on_claim(run_path: Path, resuming: bool) -> None:
        assert resolved.device is not None  # probed: not a dry run
        started["run_path"] = run_path
        _err(f"omnirl: {'resuming' if resuming else 'starting'} run in {run_path} on {resolved.device.name}")

    def on_start(controller: Any) -> None:
        started["controller"] = controller
        progress.start()
        progress.update(task, completed=controller.start_step - 1)

    def on_step(record: dict[str, Any]) -> None:
        info = (f"reward {record['reward/mean']:.4f}  loss {record.get('loss', float('nan')):+.4f}  "
                f"{record['time/step_s']:.2f}s/step")
        progress.update(task, completed=record["step"], info=info)

    try:
        run_path = run_training(resolved, manager=manager, on_step=on_step, on_start=on_start, on_claim=on_claim)
    except KeyboardInterrupt as exc:  # typer would turn it into a bare exit code
        if "run_path" not in started:
            raise
        raise RunInterrupted(
            f"interrupted: {started['run_path']} holds every finished step that was saved "
            f"({_saved_steps(started['run_path'])}).", exit_code=getattr(exc, "exit_code", 130),
            hint="Rerun the same command to resume.") from None
    finally:
        progress.stop()
    records = started["controller"].run_dir.read_metrics()
    if records:
        last = records[-1]
        _err(f"omnirl: done: {cfg.run.steps} steps, last reward/mean {last['reward/mean']:.4f}; "
             f"run directory {run_path}")


# -- plugin authoring ------------------------------------------------------------------------------

plugin_app = typer.Typer(help="Write plugins.", no_args_is_help=True)
app.add_typer(plugin_app, name="plugin")


@plugin_app.command("new")
def plugin_new(
    kind: str = typer.Argument(..., help="reward, algorithm, tracker, device, model or engine."),
    name: str = typer.Argument(..., help="The plugin's name, lowercase with dashes (e.g. my-reward)."),
    parent: str = typer.Option(".", "--dir", help="Where to create the package directory NAME."),
) -> None:
    """A new plugin package that installs, is listed and passes its tests at once (pip install -e NAME)."""
    from omnirl_core.scaffold import new_plugin

    target = new_plugin(kind, name, Path(parent))
    _err(f"omnirl: wrote {target}; next: pip install -e {target} && pytest {target}/tests")


# -- evaluate, sample, report -------------------------------------------------------------------------

def _model_for(run_dir: str | None, flags: RunFlags, manager: Any) -> Any:
    from omnirl_core.loop.evaluation import resolve_for_eval

    layers = build_layers(flags.model, flags.algo, flags.preset, None, flags.recipe, flags.overrides, None, None,
                          flags.device, None, qualified={s.qualified_name for s in manager.registries["reward"]})
    return resolve_for_eval(manager, layers, Path(run_dir) if run_dir else None, bool(flags.model or flags.recipe),
                            bool(flags.algo))


PromptOpt = typer.Option(None, "--prompt", "-p", help="A prompt, repeatable.")
RunDirArg = typer.Argument(None, help="A run directory: its config, and its latest checkpoint unless told otherwise.")
CheckpointOpt = typer.Option(None, "--checkpoint", help="A checkpoint: step-N or N of the run, or a directory.")
LoraOpt = typer.Option(None, "--lora", help="A LoRA directory (pytorch_lora_weights.safetensors) to load.")
BaseOpt = typer.Option(False, "--base", help="The base model (no trained weights).")
TrainedOpt = typer.Option(False, "--trained-weights", help="A checkpoint that holds evaluation weights "
                          "(eval-weights/: the algorithm's EMA, e.g. flowgrpo with ema=true) gives those by default; "
                          "load the trained weights instead.")


@app.command("eval")
@run_flags("model", "algo", "preset", "reward", "recipe", "overrides", "device", "output_dir",
           device=typer.Option(None, "--device", help="auto, cpu, cuda, ..."),
           output_dir=typer.Option(None, "--output-dir", "-o", help="Where eval/step-N/ goes; default: the run "
                                   "directory (runs/eval-<model>-<time> without one)."))
def eval_cmd(
    flags: RunFlags,
    run_dir: str | None = RunDirArg,
    checkpoint: str | None = CheckpointOpt,
    lora: str | None = LoraOpt,
    base: bool = BaseOpt,
    trained_weights: bool = TrainedOpt,
    compare: str | None = typer.Option(None, "--compare", help="'base': evaluate the base model too, side by side, "
                                       "with the difference and its paired standard error."),
    prompts: str | None = typer.Option(None, "--prompts", help="Prompt source (file, builtin:NAME, hf:NAME, ...); "
                                       "default: the run's data."),
    split: str = typer.Option("test", "--split", help="test (held out; all of --prompts if it has no split), train "
                              "or all."),
    samples: int = typer.Option(4, "--samples", min=1, help="Samples per prompt (fixed seeds)."),
    max_prompts: int | None = typer.Option(None, "--max-prompts", min=1, help="Evaluate on the first N prompts."),
    seed: int = typer.Option(0, "--seed", help="Evaluation seed (the same seed, the same initial noise)."),
    fmt: str = FormatOpt,
) -> None:
    """Evaluate a model on held-out prompts: fixed seeds, the deterministic (ODE) sampler, every reward."""
    from omnirl_core.api import evaluate
    from omnirl_core.loop.evaluation import eval_steps

    _check_format(fmt)
    manager = _manager()
    layers = build_layers(flags.model, flags.algo, flags.preset, flags.reward, None, flags.overrides, None,
                          None, flags.device, None, qualified={s.qualified_name for s in manager.registries["reward"]})
    config: list[dict[str, Any] | str] = [*([flags.recipe] if flags.recipe else []), *(lay for lay in layers if lay)]

    def started(described: str, cfg: Any) -> None:
        _err(f"omnirl: evaluating on {described}, {samples} sample(s) each, ODE sampler, {eval_steps(cfg)} steps, "
             f"CFG {cfg.rollout.guidance_scale:g}")

    report = evaluate(run_dir, config=config, manager=manager, checkpoint=checkpoint,
                      lora=lora, base=base, trained_weights=trained_weights, compare=compare, prompts=prompts,
                      split=split, samples=samples, max_prompts=max_prompts, seed=seed, output_dir=flags.output_dir,
                      on_start=started)
    if report.weights is not None and report.weights != report.checkpoint:
        _err(f"omnirl: evaluated {report.weights} (the algorithm's evaluation weights; --trained-weights loads the "
             "trained ones)")
    if fmt == "json":
        typer.echo(report.path.read_text())
    else:
        _print_eval(report.results, report.comparison)
    _err(f"omnirl: results in {report.path}")


def _print_eval(results, comparison) -> None:
    rows = []
    summaries = {r.label: r.summary() for r in results}
    for metric in results[0].metrics:
        row = {"metric": metric}
        for r in results:
            s = summaries[r.label][metric]
            row[r.label] = f"{s['mean']:.4f} ± {s['se']:.4f}  (n={s['n']})"
        if comparison is not None:
            c = comparison[metric]
            row["trained - base"] = f"{c['diff']:+.4f} ± {c['se']:.4f}"
            row["z"] = f"{c['z']:+.1f}"
        rows.append(row)
    columns = ["metric", *[r.label for r in results]]
    if comparison is not None:
        columns += ["trained - base", "z"]
    _print_table(rows, columns)


@app.command("sample")
@run_flags("model", "algo", "preset", "recipe", "overrides", "device",
           device=typer.Option(None, "--device", help="auto, cpu, cuda, ..."))
def sample_cmd(
    flags: RunFlags,
    run_dir: str | None = RunDirArg,
    out: str = typer.Option(..., "--out", help="Folder for the outputs (PNG, GIF for video, TXT for text)."),
    prompt: list[str] | None = PromptOpt,
    prompts: str | None = typer.Option(None, "--prompts", help="Prompt source (file, builtin:NAME, hf:NAME, ...)."),
    split: str = typer.Option("all", "--split", help="With --prompts: test, train or all."),
    checkpoint: str | None = CheckpointOpt,
    lora: str | None = LoraOpt,
    base: bool = BaseOpt,
    trained_weights: bool = TrainedOpt,
    samples: int = typer.Option(1, "--samples", min=1, help="Samples per prompt."),
    seed: int = typer.Option(0, "--seed", help="Seed (the same seed, the same initial noise)."),
) -> None:
    """Generate from a model (a run's checkpoint, a LoRA or the base) for a list of prompts into a folder."""
    from omnirl_core.loop.evaluation import (
        Evaluator,
        eval_records,
        eval_requests,
        save_samples,
        weights_to_load,
    )

    manager = _manager()
    resolved = _model_for(run_dir, flags, manager)
    weights = weights_to_load(Path(run_dir) if run_dir else None, checkpoint, lora, base)
    records = [{"prompt": p} for p in prompt or []]
    if prompts is not None:
        records += eval_records(resolved, prompts, split, None)[0]
    if not records:
        raise UsageError("No prompts.", hint="Give --prompt TEXT (repeatable) or --prompts SOURCE.")
    evaluator = Evaluator(resolved, score=False)
    if weights is not None:
        evaluator.load(weights, trained=trained_weights)
    outputs = evaluator.generate(eval_requests(records, resolved.config, samples, seed), score=False)
    rows = save_samples(outputs, Path(out))
    _err(f"omnirl: {len(rows)} sample(s) from {evaluator.loaded if weights else 'the base model'} in {out} "
         "(index: samples.jsonl)")


@app.command("report")
def report_cmd(
    run_dir: str = typer.Argument(..., help="A run directory."),
    out: str | None = typer.Option(None, "--out", help="HTML file to write; default: RUN_DIR/report.html."),
) -> None:
    """One self-contained HTML page about a run: reward, eval, KL, clip-fraction and timing curves, sample grids."""
    from omnirl_core.rundir.report import write_report

    path = write_report(Path(run_dir), Path(out) if out else None)
    _err(f"omnirl: report written to {path}")


def _saved_steps(run_path: Path) -> str:
    from omnirl_core.rundir.checkpoint import latest_checkpoint

    latest = latest_checkpoint(run_path)
    return f"latest checkpoint {latest.name}" if latest else "no checkpoint yet: a rerun starts over"


def _exit(code: int) -> None:
    """``sys.exit(code)``; but when a signal left a long native call computing on a helper thread
    (``loop.interrupts.abandoned``), the process ends at once, output flushed, instead of in the interpreter's
    shutdown, which would wait for it or tear down what it uses."""
    interrupts = sys.modules.get("omnirl_core.loop.interrupts")
    if interrupts is not None and interrupts.abandoned():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def run() -> None:
    """Console-script entry: maps errors to exit codes; tracebacks only with --debug."""
    try:
        code = app(standalone_mode=False)
        if code == 130:  # typer's answer to a KeyboardInterrupt outside a run
            _err("omnirl: interrupted")
        if isinstance(code, int) and code:
            _exit(code)
    except OmnirlError as err:
        if STATE["debug"]:
            raise
        _err(f"Error: {err.render()}")
        _exit(err.exit_code)
    except KeyboardInterrupt as exc:
        _err("omnirl: interrupted")
        _exit(getattr(exc, "exit_code", 130))
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


# Commands that live in their own module (``omnirl_cli/<name>.py``, each with ``register(app)``).
COMMAND_MODULES: tuple[str, ...] = ("reward", "env", "plan")


def _register_command_modules() -> None:
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(f"omnirl_cli.{name}").register(app)


_register_command_modules()

if __name__ == "__main__":
    run()
