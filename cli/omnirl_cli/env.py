"""``omnirl env``: environments of their own for components whose packages clash with the project's
(a serving engine's pinned transformers / diffusers / torch). See ``omnirl_core.serving.envs``."""

from __future__ import annotations

import json
import sys

import typer

env_app = typer.Typer(help="Environments of their own for engines and rewards (build, list, show the path).",
                      no_args_is_help=True)

DeviceOpt = typer.Option(None, "--device", help="cpu or cuda (default: cuda where nvidia-smi is found, else cpu).")


def _log(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


@env_app.command("build")
def build(
    name: str = typer.Argument(..., help="A component that declares an environment (see `omnirl env list`)."),
    device: str = DeviceOpt,
    force: bool = typer.Option(False, "--force", help="Rebuild even if it is built."),
) -> None:
    """Build NAME's environment from its declared requirements (a venv under the omnirl cache); prints its
    directory. Idempotent: a built environment is reused."""
    from omnirl_core.serving.envs import build_environment, component_environment

    spec = component_environment(name, device)
    _log(f"omnirl: building the environment of '{spec.name}' ({spec.device}) from {spec.source}")
    print(build_environment(spec, force=force, log=_log))


@env_app.command("path")
def path(name: str = typer.Argument(..., help="A component that declares an environment."),
         device: str = DeviceOpt) -> None:
    """The interpreter of NAME's built environment (exit 2 with how to build it when it is not built)."""
    from omnirl_core.serving.envs import component_environment, environment_python

    print(environment_python(component_environment(name, device)))


@env_app.command("list")
def list_envs(device: str = DeviceOpt, fmt: str = typer.Option("table", "--format", help="table or json.")) -> None:
    """Installed components that declare an environment, and whether it is built."""
    from omnirl_cli.common import _check_format, _print_table
    from omnirl_core.serving.envs import declared_environments

    _check_format(fmt)
    rows = declared_environments(device)
    if fmt == "json":
        print(json.dumps(rows, indent=2))
    else:
        _print_table(rows, ["name", "kind", "device", "built", "path", "description"])


def register(app: typer.Typer) -> None:
    app.add_typer(env_app, name="env")
