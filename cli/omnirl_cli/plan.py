"""``omnirl plan``: the memory a resolved run needs per device and worker group, from the architecture the run loads
(the released model, or a preset's when the model's plugin describes it) built on the ``meta`` device (no weights, no
download, no accelerator), against the device's memory. Exit 2 with the numbers and the changes that would fit when
it does not fit (or the changes tried, when none does). With ``--nodes N --devices-per-node M``, the workers of a
Ray run placed on N nodes and each node's totals (``omnirl_core.planning.nodes``). See
``omnirl_core.planning.planner``."""

from __future__ import annotations

import json

import typer


def register(app: typer.Typer) -> None:
    from omnirl_cli.common import RunFlags, _manager, run_flags

    @app.command("plan")
    @run_flags("model", "algo", "preset", "reward", "recipe", "overrides", "device", "executor",
               device=typer.Option(None, "--device", help="cpu, cuda, ... (sets run.device: the dtype 'auto' "
                                   "follows it)."),
               executor=typer.Option(None, "--executor", help="inline or ray."))
    def plan_cmd(
        flags: RunFlags,
        device_memory: str | None = typer.Option(
            None, "--device-memory", help="Memory of one device, e.g. 80GiB or 141GB; default: that of the "
            "device the run would use here (CUDA: the first GPU's; the CPU: the RAM available now)."),
        fmt: str = typer.Option("table", "--format", help="table or json."),
        nodes: int | None = typer.Option(
            None, "--nodes", help="Plan a Ray run over this many nodes: each worker group placed by its "
            "run.ray_pools strategy, with per-node totals (device and host memory)."),
        devices_per_node: int | None = typer.Option(
            None, "--devices-per-node", help="Devices (GPUs, NPUs; on the CPU, workers) of each node, with --nodes."),
    ) -> None:
        """Memory per device and worker group for a run (weights, adapters, gradients, optimizer, copies,
        activations), from the architecture the run loads, on the meta device; exit 2 when it does not fit."""
        from omnirl_core.api import plan as memory_plan
        from omnirl_core.errors import UsageError
        from omnirl_core.planning.planner import check_fits
        from omnirl_core.resolve import resolve_run

        if fmt not in ("table", "json"):
            raise UsageError(f"Unknown --format '{fmt}'.", hint="Use --format table or --format json.")
        manager = _manager()
        resolved = resolve_run(manager, flags.layers(manager), probe_device=False)
        if (nodes is None) != (devices_per_node is None):
            raise UsageError("--nodes and --devices-per-node go together.",
                             hint="Give both, e.g. --nodes 2 --devices-per-node 8.")
        plan = memory_plan(resolved, manager=manager, device_memory=device_memory)
        where = f"The run ({resolved.model.name}, {resolved.algorithm.name})"
        if nodes is None or devices_per_node is None:
            typer.echo(json.dumps(plan.as_dict(), indent=2) if fmt == "json" else plan.table())
            check_fits(plan, where)
            return
        from omnirl_core.planning.nodes import layout_nodes

        layout = layout_nodes(plan, resolved.config, nodes, devices_per_node)
        typer.echo(json.dumps({**plan.as_dict(), "nodes": layout.as_dict()}, indent=2) if fmt == "json"
                   else f"{plan.table()}\n\n{layout.table()}")
        if layout.shared:  # the CPU: each node's memory holds its workers together, not the whole run's
            layout.check()
        else:
            check_fits(plan, where)
