"""``omnirl plan``: the memory a resolved run needs per device and worker group, from the full-size architecture
built on the ``meta`` device (no weights, no download, no accelerator), against the device's memory.
Exit 2 with the numbers and the changes that would fit when it does not fit. See ``omnirl_core.plan.planner``."""

from __future__ import annotations

import json

import typer


def device_memory_bytes(text: str | None, resolved) -> int | None:
    """``--device-memory`` if given; else the memory of this machine's first accelerator of the run's device type,
    when there is one; else None (the plan is shown without a verdict)."""
    from omnirl_core.plan.planner import parse_bytes

    if text:
        return parse_bytes(text)
    if resolved.config.run.device in ("cuda", "auto"):
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_properties(0).total_memory
        except Exception:  # noqa: BLE001 - a failed probe only means no verdict
            return None
    return None


def memory_plan(resolved, device_memory: str | None):
    from omnirl_core.plan.planner import plan_memory

    return plan_memory(resolved, device_memory_bytes(device_memory, resolved))


def dry_run_memory(resolved) -> None:
    """``omnirl train --dry-run``: the memory plan under the resolved config (released checkpoints only: a preset
    is not the full-size model), against this machine's accelerator when there is one; refused when it does not
    fit."""
    from omnirl_core.plan.planner import check_fits

    if resolved.config.model.preset is not None or not getattr(resolved.model, "sizing", None):
        return
    plan = memory_plan(resolved, None)
    typer.echo("memory_plan: |\n" + "\n".join("  " + line for line in plan.table().splitlines()))
    check_fits(plan, f"The run ({resolved.model.name}, {resolved.algorithm.name})")


def register(app: typer.Typer) -> None:
    from omnirl_cli.main import RunFlags, _manager, run_flags

    @app.command("plan")
    @run_flags("model", "algo", "preset", "reward", "recipe", "overrides", "device", "executor",
               device=typer.Option(None, "--device", help="cpu, cuda, ... (sets run.device: the dtype 'auto' "
                                   "follows it)."),
               executor=typer.Option(None, "--executor", help="inline or ray."))
    def plan_cmd(
        flags: RunFlags,
        device_memory: str | None = typer.Option(
            None, "--device-memory", help="Memory of one device, e.g. 80GiB or 141GB; default: the first "
            "accelerator's here, if any."),
        fmt: str = typer.Option("table", "--format", help="table or json."),
    ) -> None:
        """Memory per device and worker group for a run (weights, adapters, gradients, optimizer, copies,
        activations), from the full-size architecture on the meta device; exit 2 when it does not fit."""
        from omnirl_core.errors import UsageError
        from omnirl_core.plan.planner import check_fits
        from omnirl_core.resolve import resolve_run

        if fmt not in ("table", "json"):
            raise UsageError(f"Unknown --format '{fmt}'.", hint="Use --format table or --format json.")
        manager = _manager()
        resolved = resolve_run(manager, flags.layers(manager), probe_device=False)
        plan = memory_plan(resolved, device_memory)
        typer.echo(json.dumps(plan.as_dict(), indent=2) if fmt == "json" else plan.table())
        check_fits(plan, f"The run ({resolved.model.name}, {resolved.algorithm.name})")
