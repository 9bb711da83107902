"""A memory plan over several nodes: where a Ray run's workers go on ``nodes`` nodes of ``devices_per_node`` devices
each, and what each node then holds (``omnirl plan --nodes N --devices-per-node M``).

Each worker group of the plan (``MemoryPlan.groups``: the actor's ranks, a rollout worker, a reference worker) is
one Ray placement group, placed as its ``run.ray_pools`` entry's strategy places it (Ray's own rules, in the order
the Ray executor creates them: train, rollout, reference):

  pack           all on the first node with room for the whole group, else the nodes with the most room first
  strict_pack    all on the first node with room for the whole group, or refused
  spread         each worker on the node that has the fewest of the group so far (then the most room)
  strict_spread  each worker on a node of its own, or refused

A node's device memory is the sum of its devices' totals; its host memory the sum of its workers' host rows
(``GroupPlan.host``). On the CPU a worker's rows are its node's memory itself (``MemoryPlan.shared``), so a node's
need is the sum of its workers' and that is what must fit. Node selectors (``resources``, ``node``) are not modelled:
the layout assumes any node can take any group. Reward workers are not planned (as on one node).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omnirl_core.errors import ConfigError, UsageError
from omnirl_core.planning.planner import GIB, HEADROOM, MemoryPlan

if TYPE_CHECKING:
    from omnirl_core.config import RunConfig

POOL_OF = {"actor": "train", "actor+rollout": "train", "rollout": "rollout", "reference": "reference"}
"""The ``run.ray_pools`` entry that places each of the plan's groups."""


@dataclass
class Worker:
    """One device's worker: its group, its index in the group, its device total and host memory (bytes)."""

    group: str
    index: int
    device: int
    host: int


@dataclass
class NodePlan:
    index: int
    workers: list[Worker] = field(default_factory=list)

    @property
    def device_total(self) -> int:
        return sum(w.device for w in self.workers)

    @property
    def largest_device(self) -> int:
        return max((w.device for w in self.workers), default=0)

    @property
    def host_total(self) -> int:
        return sum(w.host for w in self.workers)

    def groups(self) -> dict[str, int]:
        """Workers per group on this node, in placement order."""
        out: dict[str, int] = {}
        for w in self.workers:
            out[w.group] = out.get(w.group, 0) + 1
        return out


@dataclass
class NodeLayout:
    """The plan's workers on ``count`` nodes of ``devices_per_node`` devices."""

    count: int
    devices_per_node: int
    nodes: list[NodePlan]
    strategies: dict[str, str]
    shared: bool = False
    device_memory: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def used(self) -> list[NodePlan]:
        return [n for n in self.nodes if n.workers]

    @property
    def budget(self) -> int | None:
        """What one node's memory holds (a shared plan: the node's whole memory less the headroom)."""
        return None if self.device_memory is None else int(self.device_memory * (1 - HEADROOM))

    def as_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "devices_per_node": self.devices_per_node,
            "strategies": self.strategies,
            "shared": self.shared,
            "nodes": [{"index": n.index, "groups": n.groups(), "devices": len(n.workers),
                       "workers": [{"group": w.group, "index": w.index, "device_total": w.device,
                                    "host_total": w.host} for w in n.workers],
                       "device_total": n.device_total, "largest_device": n.largest_device,
                       "host_total": n.host_total} for n in self.nodes],
            "largest_node": {"device_total": max(n.device_total for n in self.nodes),
                             "host_total": max(n.host_total for n in self.nodes)},
            "notes": self.notes,
        }

    def table(self) -> str:
        """One row per node: its workers, its device memory (the sum, the largest device), its host memory."""
        memory = "memory (GiB)" if self.shared else "device memory (GiB)"
        head = ["node", f"devices (of {self.devices_per_node})", "workers", memory, "largest device (GiB)",
                "host memory (GiB)"]
        lines = [head]
        for n in self.nodes:
            workers = ", ".join(f"{g} x{c}" for g, c in n.groups().items()) or "-"
            lines.append([str(n.index), str(len(n.workers)), workers, _gib(n.device_total), _gib(n.largest_device),
                          "-" if self.shared else _gib(n.host_total)])
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        out = ["  ".join(cell.ljust(w) if i in (0, 2) else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
               for line in lines]
        out.insert(1, "  ".join("-" * w for w in widths))
        placed = ", ".join(f"{group} {strategy}" for group, strategy in self.strategies.items())
        largest = max(self.nodes, key=lambda n: n.device_total)
        summary = (f"{len(self.used)} of {self.count} node(s) used ({placed}); largest node {largest.device_total / GIB:.1f} "
                   f"GiB of {'memory' if self.shared else 'device memory'}")
        if not self.shared:
            summary += f", {max(n.host_total for n in self.nodes) / GIB:.1f} GiB of host memory"
        out.append(summary)
        out += [f"note: {note}" for note in self.notes]
        return "\n".join(out)

    def check(self) -> None:
        """A shared plan (the CPU): each node's workers together against the node's memory."""
        budget = self.budget
        if not self.shared or budget is None:
            return
        over = [n for n in self.nodes if n.device_total > budget]
        if over:
            raise ConfigError(
                f"The run's workers do not fit in the memory of {len(over)} of its {self.count} nodes.",
                details=[f"  node {n.index} ({', '.join(f'{g} x{c}' for g, c in n.groups().items())}): "
                         f"{n.device_total / GIB:.1f} GiB > budget {budget / GIB:.1f} GiB" for n in over],
                hint="Spread the groups over more nodes (--nodes, run.ray_pools.<group>.strategy=spread), or "
                     "lower what one worker holds (see the plan's rows).")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def layout_nodes(plan: MemoryPlan, config: RunConfig, nodes: int, devices_per_node: int) -> NodeLayout:
    """Place ``plan``'s workers on ``nodes`` nodes of ``devices_per_node`` devices by their groups' strategies; a
    layout the nodes cannot hold is a usage error (exit 2) naming the group and the strategy."""
    run = config.run
    if run.executor != "ray":
        raise UsageError("--nodes plans a Ray run over several nodes, and this run's executor is inline (one process "
                         "on one machine).", hint="Add --executor ray (and run.placement / run.train_workers as the "
                         "run will have them).")
    if nodes < 1 or devices_per_node < 1:
        raise UsageError(f"--nodes {nodes} --devices-per-node {devices_per_node}: both must be at least 1.")
    layout = NodeLayout(nodes, devices_per_node, [NodePlan(i) for i in range(nodes)], {},
                        shared=plan.shared, device_memory=plan.device_memory)
    needed = sum(g.devices for g in plan.groups)
    if needed > nodes * devices_per_node:
        raise UsageError(
            f"{nodes} node(s) of {devices_per_node} device(s) hold {nodes * devices_per_node} workers; this run's "
            f"groups need {needed}: " + ", ".join(f"{g.name} x{g.devices}" for g in plan.groups) + ".",
            hint="Add nodes (--nodes) or devices per node, or lower run.train_workers.")
    for group in plan.groups:
        pool = POOL_OF.get(group.name, group.name)
        entry = run.ray_pools.get(pool)  # type: ignore[call-overload]
        strategy = entry.strategy if entry is not None else "pack"
        layout.strategies[group.name] = strategy
        workers = [Worker(group.name, i, group.total, group.host_total) for i in range(group.devices)]
        _place(layout, workers, strategy, f"run.ray_pools.{pool}.strategy")
    selected = sorted(g for g, e in run.ray_pools.items() if e.resources or e.node)
    if selected:
        layout.notes.append(f"run.ray_pools {', '.join(selected)}: node selectors (resources, node) are not modelled; "
                            "the layout assumes any node can take any group, and the nodes a selector picks must "
                            "hold what it puts on them")
    hosts = [f"{g.name} {g.host_total / GIB:.2f} GiB ({', '.join(f'{k} {v / GIB:.2f}' for k, v in g.host.items())})"
             for g in plan.groups if g.host]
    if hosts:
        layout.notes.append(f"host memory per worker: {'; '.join(hosts)}; the driver's node also holds a step's "
                            "samples")
    layout.notes.append("reward workers are not planned (their models are their own; run.ray_pools.reward places "
                        "them)")
    return layout


def _place(layout: NodeLayout, workers: list[Worker], strategy: str, where: str) -> None:
    nodes = layout.nodes
    per = layout.devices_per_node

    def room(n: NodePlan) -> int:
        return per - len(n.workers)

    if strategy in ("pack", "strict_pack"):
        whole = next((n for n in nodes if room(n) >= len(workers)), None)
        if whole is not None:
            whole.workers += workers
            return
        if strategy == "strict_pack":
            raise UsageError(f"{where}=strict_pack puts all {len(workers)} {workers[0].group} workers on one node, "
                             f"but no node has {len(workers)} free device(s) of its {per}.",
                             hint="Use pack, or more devices per node.")
        left = list(workers)
        for node in sorted(nodes, key=lambda n: (-room(n), n.index)):  # the emptiest first, each filled
            take = min(room(node), len(left))
            node.workers += left[:take]
            del left[:take]
        return
    if strategy == "strict_spread":
        free = [n for n in nodes if room(n) > 0]
        if len(free) < len(workers):
            raise UsageError(f"{where}=strict_spread puts each of the {len(workers)} {workers[0].group} workers on a "
                             f"node of its own, but only {len(free)} node(s) have a free device.",
                             hint="Add nodes (--nodes), or use spread or pack.")
        for worker, node in zip(workers, sorted(free, key=lambda n: (-room(n), n.index))):
            node.workers.append(worker)
        return
    counts = {n.index: 0 for n in nodes}  # spread: the fewest of the group first, then the most room
    for worker in workers:
        node = min((n for n in nodes if room(n) > 0), key=lambda n: (counts[n.index], -room(n), n.index))
        node.workers.append(worker)
        counts[node.index] += 1
