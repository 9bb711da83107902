"""A Ray cluster of several nodes, for the Ray executor: joining it, placing each worker group on its nodes, checking
that every node runs the driver's code, and telling a lost node from any other failure.

Joining: ``run.ray_address`` (``--ray-address auto|HOST:PORT``), else ``RAY_ADDRESS``, else a local instance. Ray
2.5x clusters use token authentication; a driver without the cluster's token is refused with what it lacks.

Placement: one placement group per worker group, with the group's strategy (``run.ray_pools.<group>.strategy``) and
node selector (custom resources, or a node's address). Checked against the cluster's nodes before anything is
placed: a group no node can take, or a strict strategy the nodes cannot honour, is a usage error (exit 2) that
lists the nodes and what they have.

Versions: every actor reports the omnirl version and the versions of the plugins the run uses as its node has them
installed; any difference from the driver's stops the run at start, naming the node.

A lost node: its actors' calls fail (or a collective of the ranks that survive it does). The executor asks
``Placement.explain`` whether a node of the run died, waiting up to ``NODE_LOSS_WAIT_S`` for Ray to declare it
(its health checks); if so the run stops with a ``WorkerLostError`` naming the node and the worker groups that ran
there (the controller adds the last complete checkpoint), exit code 1. Actors are never restarted
(``max_restarts=0``): a worker that came back would hold none of the run's state.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnirl_core.errors import EXIT_RUNTIME, OmnirlError, PluginError, UsageError

if TYPE_CHECKING:
    from omnirl_core.config import RayPoolConfig
    from omnirl_core.resolve import ResolvedRun

STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK", "strict_spread": "STRICT_SPREAD"}
SELECTOR = 0.001
"""What a worker reserves of a node-selecting resource (``node:<ip>``): enough to need it, never enough to count."""
HEAD_RESOURCE = "node:__internal_head__"
NODE_LOSS_WAIT_S = 60.0
"""How long a failed call waits for Ray to declare a node dead before it is reported as the failure it is. Ray
declares a node dead after ``health_check_failure_threshold`` x ``health_check_period_ms`` without an answer (5 x 3
s by default; longer when its checks time out rather than fail)."""
ACTOR_DEATH_WAIT_S = 5.0
"""How long an actor Ray has declared dead waits for its node to be declared dead too, before it counts as a worker
process that died on a live node."""
POLL_S = 1.0
"""While the driver waits for a worker group, how often it asks Ray whether a node of the run died."""


# -- joining ---------------------------------------------------------------------------------------

def cluster_address(setting: str | None) -> tuple[str | None, str]:
    """The cluster a run joins and what named it: ``(run.ray_address, 'run.ray_address')``, ``(RAY_ADDRESS,
    'RAY_ADDRESS')`` or ``(None, 'local')`` (a local instance). Ray Client addresses are refused: a rollout streams
    its samples, which Ray Client cannot."""
    if setting:
        address, source = setting, "run.ray_address"
    elif os.environ.get("RAY_ADDRESS"):
        address, source = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    else:
        return None, "local"
    if address.startswith("ray://"):
        raise UsageError(
            f"{source}={address} is a Ray Client address; omnirl's driver cannot run through Ray Client (it streams "
            "each rollout's samples, which Ray Client does not support).",
            hint="Run `omnirl train` on a node of the cluster with --ray-address auto (or the GCS address, "
                 "HOST:6379), or submit it as a Ray job (`ray job submit -- omnirl train ...`, a KubeRay RayJob).",
        )
    return address, source


def token_sources(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """Where Ray looks for a cluster's authentication token, and what this process has there."""
    path = environ.get("RAY_AUTH_TOKEN_PATH")
    default = Path.home() / ".ray" / "auth_token"
    return {
        "RAY_AUTH_MODE": environ.get("RAY_AUTH_MODE", "unset"),
        "RAY_AUTH_TOKEN": "set" if environ.get("RAY_AUTH_TOKEN") else "unset",
        "RAY_AUTH_TOKEN_PATH": (f"{path} ({'present' if Path(path).is_file() else 'missing'})" if path else "unset"),
        str(default): "present" if default.is_file() else "missing",
    }


def _reachable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        with socket.create_connection((host, int(port)), timeout=3):
            return True
    except OSError:
        return False


def join(address: str, source: str, runtime_env: dict[str, Any] | None) -> None:
    """Connect this driver to the cluster at ``address``; a failure is a usage error that says what is missing."""
    import ray
    from ray.exceptions import AuthenticationError

    sources = token_sources()
    details = [f"{name}: {value}" for name, value in sources.items()]
    token_hint = ("The cluster's token: `ray get-auth-token` on its head prints it. Give it to this driver as "
                  "RAY_AUTH_TOKEN (or a file named by RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token) with RAY_AUTH_MODE="
                  "token.")
    try:
        ray.init(address=address, runtime_env=runtime_env)
    except AuthenticationError as exc:
        raise UsageError(f"The Ray cluster at {address} ({source}) needs token authentication, and this driver has "
                         f"no usable token: {str(exc).split('.')[0]}.", details=details, hint=token_hint) from exc
    except ConnectionError as exc:
        if address == "auto":
            raise UsageError("No Ray cluster runs on this machine (--ray-address auto).",
                             details=[str(exc).splitlines()[0]],
                             hint="Start one (`ray start --head`), or give the head's address: --ray-address "
                                  "HOST:6379.") from exc
        if not _reachable(address):
            raise UsageError(f"No Ray cluster answers at {address} ({source}).", details=[str(exc).splitlines()[0]],
                             hint="Check the head's address and port (`ray status` on the head) and that this "
                                  "machine can reach it.") from exc
        no_token = sources["RAY_AUTH_TOKEN"] == "unset" and "present" not in sources["RAY_AUTH_TOKEN_PATH"] and \
            sources[str(Path.home() / ".ray" / "auth_token")] != "present"
        if sources["RAY_AUTH_MODE"] == "disabled":
            why = "it likely needs token authentication, which RAY_AUTH_MODE=disabled turns off in this driver."
        elif no_token:
            why = "it likely needs token authentication, and this driver has no token."
        else:
            why = "the token this driver has is likely not the cluster's, or its Ray version differs."
        first = f"The Ray cluster at {address} ({source}) answers but refused this driver: {why}"
        raise UsageError(first, details=[str(exc).splitlines()[0], *details],
                         hint=token_hint + " The driver's Ray must be the cluster's version.") from exc


# -- nodes and placement ---------------------------------------------------------------------------

@dataclass
class Node:
    node_id: str
    ip: str
    hostname: str
    alive: bool
    resources: dict[str, float]

    @property
    def head(self) -> bool:
        return HEAD_RESOURCE in self.resources

    def label(self) -> str:
        """How errors name a node: its address, id prefix and role."""
        return f"{self.ip} (node {self.node_id[:12]}{', head' if self.head else ''})"


def cluster_nodes() -> list[Node]:
    import ray

    return [Node(n["NodeID"], n.get("NodeManagerAddress", "?"), n.get("NodeManagerHostname", "?"), bool(n["Alive"]),
                 {k: float(v) for k, v in n.get("Resources", {}).items()}) for n in ray.nodes()]


@dataclass
class Pool:
    """One worker group's placement group: a bundle per worker, and how Ray spreads them."""

    group: str
    bundles: list[dict[str, float]]
    strategy: str = "pack"

    @property
    def ray_strategy(self) -> str:
        return STRATEGIES[self.strategy]


def group_pool(group: str, bundle: dict[str, float], count: int, config: RayPoolConfig | None) -> Pool:
    """The pool of ``count`` workers of ``group``, each reserving ``bundle`` plus the group's node selector."""
    if config is None:
        return Pool(group, [dict(bundle)] * count)
    selected = {**bundle, **config.resources}
    if config.node is not None:
        selected[HEAD_RESOURCE if config.node == "head" else f"node:{config.node}"] = SELECTOR
    return Pool(group, [dict(selected)] * count, config.strategy)


def _fits(node: Node, need: dict[str, float]) -> bool:
    return all(node.resources.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


def check_pools(pools: list[Pool], nodes: list[Node]) -> None:
    """Refuse, with every problem at once, pools the cluster's live nodes can never hold: a bundle no node has the
    resources for (a selector that matches nothing), strict_spread over fewer eligible nodes than workers,
    strict_pack on no node that holds them all. (Whether they are free now is Ray's business: placement waits.)"""
    live = [n for n in nodes if n.alive]
    problems = []
    for pool in pools:
        if not pool.bundles:
            continue
        need = pool.bundles[0]
        where = f"run.ray_pools.{pool.group}"
        selector = sorted(k for k in need if k.startswith("node:"))
        for key in selector:
            if not any(key in n.resources for n in live):
                known = ", ".join(sorted({n.ip for n in live}))
                problems.append(f"  {where}.node: no live node has the address '{key.removeprefix('node:')}' "
                                f"(nodes: {known or 'none'})")
        eligible = [n for n in live if _fits(n, need)]
        if not eligible:
            if not selector:
                problems.append(f"  {where}: no node has what one {pool.group} worker reserves {need}")
            continue
        count = len(pool.bundles)
        if pool.strategy == "strict_spread" and len(eligible) < count:
            problems.append(f"  {where}.strategy: strict_spread puts each of the {count} {pool.group} workers on a "
                            f"node of its own, but only {len(eligible)} node(s) have {need}")
        if pool.strategy == "strict_pack":
            total = {k: v * count for k, v in need.items()}
            if not any(_fits(n, total) for n in eligible):
                problems.append(f"  {where}.strategy: strict_pack puts all {count} {pool.group} workers on one node, "
                                f"but no node has {total}")
    if problems:
        raise UsageError(
            f"The Ray cluster's nodes cannot hold this run's worker groups as placed: {len(problems)} problem(s).",
            details=[*problems, "Live nodes:", *(f"  {n.label()}: {_shown(n.resources)}" for n in live)],
            hint="Change run.ray_pools (strategy, resources, node), run.train_workers or run.worker_cpus, or add "
                 "nodes with those resources (`ray start --resources '{\"NAME\": 1}'`).",
        )


def _first_line(exc: BaseException) -> str:
    """What an error says, in a line: a worker's error (Ray's task error wraps it under a header), or Ray's own."""
    from ray.exceptions import RayTaskError

    if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException):
        exc = exc.cause
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _shown(resources: dict[str, float]) -> str:
    """A node's resources as errors show them: without Ray's bookkeeping ones (memory, object store, its address)."""
    kept = {k: v for k, v in sorted(resources.items())
            if k not in ("memory", "object_store_memory") and not k.startswith("node:")}
    return ", ".join(f"{k}={v:g}" for k, v in kept.items())


# -- code on the nodes -----------------------------------------------------------------------------

def run_modules(resolved: ResolvedRun) -> list[str]:
    """The top-level modules of the run's components (their factories'), which the version check follows to
    their distributions."""
    specs = [resolved.model, resolved.algorithm, resolved.rollout_engine, resolved.train_engine, *resolved.rewards]
    if resolved.device is not None:
        specs.append(resolved.device)
    modules = set()
    for spec in specs:
        factory = spec.factory
        name = factory.split(":")[0] if isinstance(factory, str) else str(factory.__module__)
        if name:
            modules.add(name.split(".")[0])
    return sorted(modules)


def installed_versions(modules: list[str]) -> dict[str, str]:
    """The versions this process has installed of omnirl and of the plugin distributions that provide ``modules``
    (through their ``omnirl.plugins`` entry points: what the driver's plugin manager loads them by). A module that
    no installed distribution provides (a plugin registered by its module) is left out, on every node alike."""
    from importlib import metadata

    try:
        out = {"omnirl": metadata.version("omnirl")}
    except metadata.PackageNotFoundError:
        out = {"omnirl": "not installed"}
    wanted = set(modules)
    for entry in metadata.entry_points(group="omnirl.plugins"):
        top = entry.value.split(":")[0].split(".")[0]
        if top in wanted and entry.dist is not None:
            out[entry.dist.metadata["Name"]] = entry.dist.version
    return out


def version_differences(driver: dict[str, str], node: dict[str, str]) -> list[str]:
    return [f"{name}: {driver.get(name, 'not installed')} on the driver, {node.get(name, 'not installed')} there"
            for name in sorted(set(driver) | set(node)) if driver.get(name) != node.get(name)]


def check_versions(driver: dict[str, str], reports: list[tuple[Placed, dict[str, str]]]) -> None:
    """Refuse a run whose workers run other omnirl or plugin versions than the driver (one problem per node)."""
    by_node: dict[str, tuple[Placed, list[str]]] = {}
    for placed, versions in reports:
        diffs = version_differences(driver, versions)
        if diffs and placed.node_id not in by_node:
            by_node[placed.node_id] = (placed, diffs)
    if not by_node:
        return
    details = []
    for placed, diffs in by_node.values():
        details.append(f"node {placed.where()} (its {placed.name()} runs there):")
        details += [f"  {d}" for d in diffs]
    first = next(iter(by_node.values()))[0]
    raise PluginError(
        f"Ray node {first.where()} runs other omnirl or plugin versions than this driver"
        + (f" (and {len(by_node) - 1} more node(s))" if len(by_node) > 1 else "") + ".",
        details=details,
        hint="Install the driver's versions on every node (the same image or `pip install` line), or ship them "
             "with the run: run.ray_runtime_envs.<group>.py_modules / working_dir (Ray's runtime environment).",
    )


# -- where the workers are, and losing them --------------------------------------------------------

@dataclass
class Placed:
    """One actor of the run and where it runs (``runtime.json``'s ``ray.groups``)."""

    group: str
    index: int
    actor_id: str
    node_id: str
    ip: str
    hostname: str
    pid: int

    def name(self) -> str:
        return f"{self.group} worker {self.index}" if self.group != "train" else f"train rank {self.index}"

    def where(self) -> str:
        return f"{self.ip} (node {self.node_id[:12]})"

    def record(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "group"}


class WorkerLostError(OmnirlError):
    """A worker of the run was lost with its node (or its process died): the run's state in it is gone, so the run
    stops; the same command resumes from the last complete checkpoint."""

    exit_code = EXIT_RUNTIME

    def __init__(self, phase: str, node: Node | None, lost: list[Placed], cause: str):
        self.phase, self.node, self.lost, self.cause = phase, node, lost, cause
        groups = sorted({p.group for p in lost})
        what = ", ".join(p.name() for p in lost) or "workers of the run"
        if node is not None:
            first = f"Ray node {node.label()} was lost during the {phase}: the {'/'.join(groups)} group's {what} ran there."
        elif lost:
            first = (f"The {'/'.join(groups)} group's {what} on {lost[0].where()} died during the {phase} (its node "
                     "is alive: the worker's process ended).")
        else:
            first = f"A worker of the run was lost during the {phase}."
        super().__init__(first, details=[f"Ray: {cause}"],
                         hint="Bring the cluster back to the resources the run needs (`ray status`), then rerun the "
                              "same command: it resumes from the last complete checkpoint.")

    def locate(self, step: int | None, checkpoint: Path | None) -> None:
        """Add where the run stands: the step that was lost and the checkpoint it resumes from."""
        if step is not None:
            self.message = self.message.replace(f"during the {self.phase}", f"during step {step} ({self.phase})", 1)
            self.args = (self.message,)
        if checkpoint is None:
            self.details.append("Last complete checkpoint: none (the run starts over when rerun).")
        else:
            self.details.append(f"Last complete checkpoint: {checkpoint}; nothing after it was saved.")
        self.hint = ("Bring the cluster back to the resources the run needs (`ray status`), then rerun the same "
                     + ("command: it resumes from " + checkpoint.name + " exactly." if checkpoint is not None else
                        "command."))


@dataclass
class Placement:
    """The run's actors and their nodes: what ``runtime.json`` records and what a failure is checked against."""

    placed: list[Placed] = field(default_factory=list)

    def groups(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for p in self.placed:
            out.setdefault(p.group, []).append(p.record())
        return out

    def dead(self) -> list[Node]:
        """The run's nodes Ray has declared dead (or forgotten)."""
        ours = {p.node_id for p in self.placed}
        nodes = {n.node_id: n for n in cluster_nodes()}
        return [nodes.get(i) or Node(i, next(p.ip for p in self.placed if p.node_id == i), "?", False, {})
                for i in sorted(ours) if i not in nodes or not nodes[i].alive]

    def lost_on(self, node: Node, phase: str, cause: str) -> WorkerLostError:
        return WorkerLostError(phase, node, [p for p in self.placed if p.node_id == node.node_id], cause)

    def explain(self, exc: BaseException, phase: str, suspect: bool = False) -> WorkerLostError | None:
        """Whether ``exc`` comes from a lost worker: a node of the run that Ray declares dead within
        ``NODE_LOSS_WAIT_S`` (waited for when the error is Ray's own, or ``suspect``: a collective of a
        distributed group that broke), else an actor of the run that died on a live node; None otherwise."""
        from ray.exceptions import ActorDiedError, RayActorError, RayError, RayTaskError

        system = isinstance(exc, RayError) and not isinstance(exc, RayTaskError)
        # Ray declares an actor dead once it knows why: a node that died is dead by then, give or take the news
        wait = ACTOR_DEATH_WAIT_S if isinstance(exc, ActorDiedError) else NODE_LOSS_WAIT_S
        deadline = time.monotonic() + (wait if system or suspect else 0.0)
        cause = _first_line(exc)
        while True:
            dead = self.dead()
            if dead:
                return self.lost_on(dead[0], phase, cause)
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        if isinstance(exc, RayActorError):
            lost = [p for p in self.placed if p.actor_id == exc.actor_id]
            return WorkerLostError(phase, None, lost, cause)
        return None

    def gather(self, refs: list[Any], phase: str, members: list[Placed] | None = None) -> list[Any]:
        """``ray.get(refs)`` for the calls of one phase, failing as soon as any of them fails (``ray.get`` of a list
        would wait for the others: ranks stuck in a collective with a lost rank wait for the backend's timeout) or
        a node of the run dies. ``members``: the actor of each call; a call that fails with an error that is not
        omnirl's own is then named with its worker and node (setting up: a node that lacks the model, a package)."""
        import ray
        from ray.exceptions import RayTaskError

        values: dict[int, Any] = {}
        pending = {id(r): r for r in refs}
        order = [id(r) for r in refs]
        while pending:
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=POLL_S)
            for ref in ready:
                try:
                    values[id(ref)] = ray.get(ref)  # raises at once for a call that failed
                except RayTaskError as exc:
                    cause = exc.cause
                    if members is None:
                        raise
                    who = members[order.index(id(ref))]
                    if isinstance(cause, OmnirlError):  # omnirl's own message, with where it happened
                        cause.details.append(f"(the {who.name()}, on Ray node {who.where()})")
                        raise cause from exc
                    raise UsageError(
                        f"The {who.name()} could not {phase} on Ray node {who.where()}: {type(cause).__name__}: "
                        f"{cause}",
                        hint="Each node loads the model itself (model.path or the hub id, with its own cache) and "
                             "needs the run's packages: check that node (--debug shows the worker's traceback).",
                    ) from exc
                pending.pop(id(ref))
            if pending:
                dead = self.dead()
                if dead:
                    raise self.lost_on(dead[0], phase, "the node was declared dead while the driver waited")
        return [values[i] for i in order]
