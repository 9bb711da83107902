"""The Ray executor: worker groups as Ray actors on resource pools, the same controller as ``inline``.

Pools (Ray placement groups), named by the hardware plugin's ``DeviceSpec.ray_resource`` (CPU, GPU, NPU):
  train    ``run.train_workers`` actor ranks forming a torch.distributed group (the device's backend);
           with ``placement: colocated`` the single rank also holds the rollout engine (one model, no
           weight copy);
  rollout  ``placement: split`` only: a rollout worker; weights are synced to it after each update
           (LoRA only when training LoRA, the full denoiser otherwise);
  reference ``run.reference=separate`` and an algorithm with a KL term: a worker holding the frozen base
           model; at each update it evaluates the reference outputs of the batch while the train ranks run
           their own no-grad pass (old log-probs), and every rank fetches them before its first loss (the
           actor then keeps no frozen copy in full fine-tuning);
  reward   ``run.reward_workers`` reward actors with the resources the rewards declare, each serving
           ``run.reward_concurrency`` calls at once (threads, for rewards that wait on I/O); or, with
           ``run.reward_serving=serve``, no pool: a Ray Serve deployment whose replicas reserve the same
           resources and selector (``omnirl_core.loop.ray_serve_rewards``: dynamic batching, autoscaling).

Each pool is one placement group, placed by the group's ``run.ray_pools`` entry (strategy, node selector) on a
cluster of one node or many (``omnirl_core.loop.cluster``: joining, placement checks, the version check, a lost
node). ``runtime.json`` records the node of every actor. No disk is shared: a checkpoint's files travel from the
train ranks to the driver through Ray, and back to them on resume (``omnirl_core.loop.transfer``); the samples
and the evaluation outputs reach the driver as the rollout's objects. Actors are never restarted: a worker that
came back would hold none of the run's state, so a lost one stops the run (``WorkerLostError``) for an exact resume.

Every actor runs at ``run.ray_worker_niceness`` (0: the driver's priority). Ray's own default renices its workers
to 15, so that any other process on the node runs first; on a node that is busy with anything else (data
loading, a reward server, another job) the rollout and the update then get a sliver of the CPUs.

Rollout streams: the rollout worker's ``generate`` is a Ray streaming generator; each finished sample
becomes two objects in Ray's store, its reward view (output, prompt, inputs: what rewards read) and the
sample. In async mode the controller hands each view to a reward actor the moment it appears (it goes
from store to reward actor, not through the controller), so rewards overlap the rest of the rollout; in
sync mode the views are scored after the rollout. The update waits for all of it. Reward actors are async
actors: a reward that judges on its own loop (``submit``, e.g. a remote VLM judge) gets the samples that finish
together in one call, and its calls overlap; any other reward scores on a thread of the actor.

Trajectories stay where they were made when they can: with ``placement: colocated``, no separate reference
worker and an algorithm whose controller side reads no trajectory (``Algorithm.controller_reads_trajectory``,
the flow policy-gradient family), the worker keeps each sample's trajectory (latents, sigmas, log-probs,
conditioning) in its memory and streams one object per sample, its reward view, which is also the
controller's sample. The units of the update come back without trajectories and the worker puts its own
back into them. A sample's trajectory would otherwise travel to the controller and back each step: the
latents of every denoising step, which for a video model are tens of MB a sample.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from omnirl_core.contracts import TRAJECTORY_FIELDS, Executor, GenRequest, Sample
from omnirl_core.errors import UsageError
from omnirl_core.loop import ray_watchdog
from omnirl_core.loop.cluster import (
    POLL_S,
    Placed,
    Placement,
    Pool,
    WorkerLostError,
    check_pools,
    check_versions,
    cluster_address,
    cluster_nodes,
    group_pool,
    installed_versions,
    join,
    run_modules,
)
from omnirl_core.loop.executors import build_rewards
from omnirl_core.loop.transfer import (
    IN_FLIGHT,
    Receiver,
    Shipped,
    TransferError,
    chunks_of,
    digest,
    files_in,
    owners,
    rank_part,
    scratch,
    ship,
    unpack,
)
from omnirl_core.loop.worker import Worker, reference_placement
from omnirl_core.resolve import ResolvedRun

if TYPE_CHECKING:
    from omnirl_core.contracts import TrainEngine
    from omnirl_core.loop.ray_serve_rewards import ServedRewards

log = logging.getLogger("omnirl.ray")
POOL_TIMEOUT_S = 120.0


class WorkerActor:
    """A ``Worker`` inside a Ray actor (wrapped with ``ray.remote`` at setup)."""

    def __init__(self, resolved: ResolvedRun, roles: list[str], rank: int, world_size: int):
        self.worker = Worker(resolved, set(roles), rank=rank, world_size=world_size)
        self.held: dict[int, Sample] = {}  # the last rollout's trajectories, by hold key (``generate(hold=True)``)
        self.staged: Path | None = None  # run.storage: this worker's part of the checkpoint being saved

    def where(self, modules: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
        """Where this actor runs (``actor_location``) and the omnirl / plugin versions its node has installed."""
        return actor_location(), installed_versions(modules)

    def address(self) -> tuple[str, int]:
        import ray

        from omnirl_core.loop.distributed import free_port

        return ray.util.get_node_ip_address(), free_port()

    def init_group(self, backend: str, address: str, port: int) -> None:
        from omnirl_core.loop.distributed import init_process_group

        init_process_group(backend, self.worker.rank, self.worker.world_size, address, port)

    def setup(self) -> None:
        self.worker.setup()  # its thread policy: run.threads, else the CPUs Ray assigned this actor

    def torch_threads(self) -> int:
        import torch

        return torch.get_num_threads()

    def generate(self, requests: list[GenRequest], evaluation: bool = False, hold: bool = False):
        """Per finished sample two objects: what its rewards read (``reward_view``), then the sample. ``hold``:
        one object, the reward view with the key under which this worker keeps the sample (``update`` puts the
        trajectory back); the trajectories of an earlier rollout are dropped."""
        self.worker.adapt_threads()  # run.threads: adaptive, at the step boundary
        self.held.clear()
        for sample in self.worker.generate(requests, evaluation):
            if hold:
                key = len(self.held)
                self.held[key] = sample
                view = reward_view(sample)
                view.extras[HELD_KEY] = key
                yield view
            else:
                yield reward_view(sample)
                yield sample

    def update(self, units: list[Any], step: int, reference: list[Any] | None = None) -> dict[str, float]:
        """``reference``: [ObjectRef] of the reference worker's outputs, boxed in a list so that Ray does not
        wait for it before the call: the actor runs its own no-grad pass first, then fetches it."""
        import ray

        restore_trajectories(units, self.held)
        self.held.clear()
        fetch = (lambda: ray.get(reference[0])) if reference else None
        return self.worker.update(units, step, reference=fetch)

    def reference_outputs(self, units: list[Any]) -> list[dict[str, Any]]:
        return self.worker.reference_outputs(units)

    def trained_state(self, evaluation: bool = False) -> dict[str, Any] | None:
        return self.worker.trained_state(evaluation)

    def set_old_logprob(self, mode: str) -> None:
        self.worker.set_old_logprob(mode)

    def load_trained_state(self, state: dict[str, Any]) -> int:
        from omnirl_core.weights import state_bytes

        self.worker.load_trained_state(state)
        return state_bytes(state)

    def save_state(self) -> Iterator[Any]:
        """A streaming call: this worker's part of a checkpoint, written into a scratch directory of its node (the
        names the components listed first, then every file as ``transfer.Chunk`` objects); the driver writes them into
        the checkpoint. A sharded engine's save is a collective: it is over before the first item."""
        with scratch() as directory:
            yield self.worker.save_state(directory)
            yield from chunks_of(directory)

    def load_state(self, files: list[Shipped]) -> int:
        """This worker's part of a checkpoint, fetched from the driver into a scratch directory of its node
        (checksums checked) and loaded; the bytes fetched."""
        with scratch() as directory:
            moved = unpack(files, directory)
            self.worker.load_state(directory)
        return moved

    # run.storage: the worker's files go to the storage, not through the driver
    def stage_state(self) -> tuple[list[str], dict[str, tuple[str, int]]]:
        """A stored save's first half: this worker's part of a checkpoint, written into a scratch directory of its
        node and kept for ``store_state``; the names the components listed, and each file's SHA-256 and size. A
        sharded engine's save is a collective."""
        import tempfile

        self.drop_staged()
        self.staged = Path(tempfile.mkdtemp(prefix="omnirl-ckpt-"))
        listed = self.worker.save_state(self.staged)
        return listed, {name: digest(self.staged / name) for name in files_in(self.staged)}

    def store_state(self, location: str, directory: str, names: list[str]) -> dict[str, tuple[str, int]]:
        """The second half: the staged files ``names`` (this worker's: a file several ranks wrote goes from one) to
        ``directory`` below the storage ``location``; each file's SHA-256 and size as copied. The scratch goes."""
        from omnirl_core.rundir.storage import Storage

        try:
            storage = Storage(location)
            assert self.staged is not None, "store_state without stage_state"
            return {name: storage.put(self.staged / name, directory, name) for name in names}
        finally:
            self.drop_staged()

    def drop_staged(self) -> None:
        if self.staged is not None:
            import shutil

            shutil.rmtree(self.staged, ignore_errors=True)
            self.staged = None

    def fetch_state(self, entry: dict[str, Any], names: list[str], manifest: str) -> int:
        """This worker's part of a stored checkpoint (``entry``: its ``storage.json``), fetched from the storage into
        a scratch directory of its node (each file's SHA-256 checked) and loaded; the bytes fetched."""
        from omnirl_core.rundir.storage import fetch

        with scratch() as directory:
            moved = fetch(entry, names, directory, manifest)
            self.worker.load_state(directory)
        return moved


def actor_location() -> dict[str, Any]:
    """This actor (its Ray id) and where it runs: the node's id and address, the host's name, the pid."""
    import socket

    import ray

    context = ray.get_runtime_context()
    return {"actor_id": context.get_actor_id(), "node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(), "pid": os.getpid()}


def reward_view(sample: Sample) -> Sample:
    """The part of a sample its rewards read (output, prompt, request inputs), without the trajectory and the
    conditioning: what travels to a reward actor."""
    return Sample(request=sample.request, latents=None, sigmas=None, logprobs=None, output=sample.output)


HELD_KEY = "omnirl.held"  # in a held sample's extras: its key in the worker that made it


def shed_outputs(units: list[Any]) -> list[Any]:
    """The units as they go to the worker that holds their samples: each held sample without its decoded output,
    which the update does not need from the controller (``restore_trajectories`` puts the worker's own back). The
    outputs are most of what the units would carry (an image a sample; for a video model, frames). The
    controller's units and samples are left as they are; units that cannot be copied go whole."""
    bare: dict[int, Sample] = {}
    out = []
    for unit in units:
        sample = unit.sample
        if not isinstance(sample, Sample) or HELD_KEY not in sample.extras or sample.output is None:
            out.append(unit)
            continue
        light = bare.get(id(sample))
        if light is None:  # units share their sample, and still do
            light = bare[id(sample)] = dataclasses.replace(sample, output=None)
        try:
            copied = copy.copy(unit)
            copied.sample = light
        except (AttributeError, TypeError):  # a frozen unit: sent as it is
            copied = unit
        out.append(copied)
    return out


def restore_trajectories(units: list[Any], held: dict[int, Sample]) -> int:
    """Puts the worker's kept trajectories (and outputs, where ``shed_outputs`` left them out) back into the samples
    of ``units`` that came without them (their ``extras`` hold a ``HELD_KEY``); what the controller set on them
    (rewards, advantage) stays. Returns how many samples were restored; an error names a sample this worker does not hold (a step's units sent after the next
    rollout began)."""
    restored = 0
    for unit in units:
        sample = unit.sample
        if not isinstance(sample, Sample) or HELD_KEY not in sample.extras:
            continue  # not held, or restored already (units share their sample)
        key = sample.extras[HELD_KEY]
        if key not in held:
            raise RuntimeError(f"a unit's sample (held key {key}, prompt {sample.prompt!r}) is not held by this "
                               "worker: its trajectory went with a later rollout")
        source = held[key]
        for name in TRAJECTORY_FIELDS:
            setattr(sample, name, getattr(source, name))
        sample.extras = source.extras
        if sample.output is None:  # sent without it (``shed_outputs``)
            sample.output = source.output
        restored += 1
    return restored


class RewardActor:
    """Scores samples with the run's rewards; returns the scores, never the samples."""

    def __init__(self, resolved: ResolvedRun):
        from omnirl_core.host.threads import configure

        configure("fixed")  # torch's pools sized to the CPUs Ray assigned this actor, not to the machine
        self.rewards = build_rewards(resolved)

    def where(self, modules: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
        return actor_location(), installed_versions(modules)

    def torch_threads(self) -> int:
        import torch

        return torch.get_num_threads()

    def batch_capacity(self) -> int:
        """``RewardSet.batch_capacity``: above 0 (every reward judges a batch on its own threads or loop, e.g. a
        remote judge), the driver sends the samples that finish together in one call, up to this many."""
        return self.rewards.batch_capacity

    def batch_invariant(self) -> bool:
        """``RewardSet.batch_invariant``: the driver batches the samples that pile up (``run.reward_batching``)."""
        return self.rewards.batch_invariant

    async def score(self, *samples: Sample) -> tuple[list[tuple[dict[str, float], float]], float]:
        """An async actor: its calls run on its event loop, as many at once as ``_RewardDispatch`` sends
        (``run.reward_concurrency``, or for rewards with ``submit`` every wave). A reward with ``submit`` is awaited
        there (calls overlap without a thread each); any other runs on a thread of the loop's executor, so that a
        CPU-bound reward scores as in a threaded actor."""
        start = time.perf_counter()
        await self.rewards.ascore(list(samples))
        return [(s.rewards, s.reward) for s in samples], time.perf_counter() - start


class _RewardDispatch:
    """Reward calls of one rollout over the reward actors' call slots (actors x ``reward_concurrency``), in the
    order of the samples. Async: a sample goes at once to a free slot; while every slot is busy, samples wait, and
    a slot that frees takes the next one, or with ``batching`` (``run.reward_batching``) its fair share of them
    (the waiting count over the slots) in one call: fewer, larger calls when the rewards lag behind.

    Rewards that judge a batch on their own loop (``coalesce``: every reward has ``submit``) have no slots: a
    call costs the actor no thread, and the reward's own capacity (the judge's requests in flight) is the bound,
    one sample at a time, so each wave goes at once in a call of up to ``coalesce`` samples."""

    def __init__(self, actors: list[Any], concurrency: int, batching: bool = True, coalesce: int = 0):
        self.actors, self.concurrency, self.batching = actors, concurrency, batching
        self.coalesce = coalesce
        """Above 0, the rewards judge a batch concurrently (``RewardActor.batch_capacity``): a free slot takes up to
        this many waiting samples in one call, and the samples that finish together wait for each other
        (``COALESCE_S``)."""
        self.slots = math.inf if coalesce else len(actors) * concurrency
        self.calls: list[Any] = []
        self.pending: list[Any] = []
        self._busy: dict[Any, int] = {}  # in-flight call -> its actor's index
        self._load = [0] * len(actors)

    def send(self, views: list[Any]) -> None:
        index = min(range(len(self.actors)), key=self._load.__getitem__)
        call = self.actors[index].score.remote(*views)
        self.calls.append(call)
        self._busy[call] = index
        self._load[index] += 1

    def _free(self, timeout: float | None) -> None:
        import ray

        if not self._busy:
            return
        done, _ = ray.wait(list(self._busy), num_returns=1 if timeout is None else len(self._busy), timeout=timeout)
        for call in done:
            self._load[self._busy.pop(call)] -= 1

    def _send_shares(self) -> None:
        while self.pending and len(self._busy) < self.slots:
            # an int: ``slots`` is infinite only when coalescing
            share = int(max(1, -(-len(self.pending) // self.slots))) if self.batching and not self.coalesce else 1
            if self.coalesce:
                share = max(share, min(len(self.pending), self.coalesce))
            self.send(self.pending[:share])
            del self.pending[:share]

    def add(self, view: Sample) -> None:
        self.pending.append(view)
        self.flush()

    def flush(self) -> None:
        """The waiting samples to the free slots (a full pool first checks for a call that finished)."""
        if len(self._busy) >= self.slots:
            self._free(timeout=0)
        self._send_shares()

    def slot_free(self) -> bool:
        return len(self._busy) < self.slots

    def in_flight(self) -> list[Any]:
        return list(self._busy)

    def waiting(self) -> bool:
        """Samples wait while every slot is busy: a call that finishes should take them at once."""
        return bool(self.pending) and not self.slot_free()

    def refill(self) -> None:
        """The slots of the calls that finished take the waiting samples."""
        self._free(timeout=0)
        self._send_shares()

    def drain(self) -> None:
        """After the rollout: every waiting sample sent, each share as a slot frees."""
        self._send_shares()
        while self.pending:
            self._free(timeout=None)
            self._send_shares()


class _ServeDispatch(_RewardDispatch):
    """Reward calls of one rollout to the rewards' Serve deployment (``run.reward_serving=serve``): every sample goes
    at once as a request of its own; Serve routes, queues and batches them (the replicas' slots are its business,
    and the queue it sees is what scales the replicas), so no sample waits at the driver."""

    def __init__(self, served: ServedRewards):
        super().__init__([served], concurrency=1, batching=False, coalesce=0)
        self.served = served
        self.slots = math.inf

    def send(self, views: list[Any]) -> None:
        for view in views:
            self.calls.append(self.served.send(view))

    def _free(self, timeout: float | None) -> None:
        return  # nothing is held at the driver


ASYNC_ACTOR_CALLS = 1000
"""Calls a reward actor accepts at once (Ray's own default for an async actor); ``_RewardDispatch`` decides how
many it gets."""

COALESCE_S = 0.01
"""How long the driver waits for the next sample of a wave before it sends a coalesced reward call: the samples
that finish together leave the rollout worker back to back, well within it."""


def consume_stream(stream: Any, dispatch: _RewardDispatch, hold: bool, score: bool) -> tuple[list[Any], list[Any]]:
    """Reads a rollout's stream (per sample its reward view, then the sample; ``hold``: the view only, which is
    also the sample) into (views, samples), and with ``score`` hands each view to a reward call slot as it comes.
    While samples wait for a slot, whichever comes first is taken: the next sample, or a finished call, whose
    slot then takes the waiting samples at once rather than when the next sample arrives."""
    import ray

    views: list[Any] = []
    samples: list[Any] = []
    while True:
        if score and dispatch.pending:
            # coalescing: while a call could carry more and the next item is about to come (the rest of a wave
            # that finished together), read it first; it goes in the same call
            more = len(dispatch.pending) < dispatch.coalesce and dispatch.slot_free() and bool(
                ray.wait([stream], num_returns=1, timeout=COALESCE_S, fetch_local=False)[0])
            if not more:
                dispatch.flush()
        if score and dispatch.waiting():
            ready, _ = ray.wait([stream, *dispatch.in_flight()], num_returns=1, fetch_local=False)
            if not any(r is stream for r in ready):
                dispatch.refill()
                continue
        try:
            ref = next(stream)
        except StopIteration:
            return views, samples
        if not hold and len(views) > len(samples):  # the sample after its view
            samples.append(ref)
            continue
        views.append(ref)
        if hold:
            samples.append(ref)
        if score:  # straight from the object store to a reward actor with a free call slot (at the loop's top)
            dispatch.pending.append(ref)


LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch between a node reachable from other machines and one on the loopback only (its default off
Linux): with ``0`` the node's address is 127.0.0.1 and the GCS, the raylet, the workers and the agents listen on
it alone."""


def loopback_only() -> None:
    """Make the local Ray instance a run starts (no ``run.ray_address``) listen on 127.0.0.1 only, not on every
    interface: nothing else needs to reach it, and Ray's RPC takes no credentials. Ray reads the switch when it
    is imported (its processes inherit it), so it is set before; joining a cluster (``--ray-address``) leaves Ray
    as the cluster is."""
    import sys

    if "ray" not in sys.modules:
        os.environ[LOOPBACK_ENV] = "0"
        return
    from ray._private import ray_constants  # imported already: its switch is read

    if ray_constants.ENABLE_RAY_CLUSTER:
        log.warning("Ray was imported before the run started its local instance, which will listen on every "
                    "interface of this machine; set %s=0 before starting omnirl to keep it on 127.0.0.1",
                    LOOPBACK_ENV)


RUNTIME_ENV_KEYS = ("py_executable", "pip", "uv", "env_vars", "working_dir", "py_modules", "environment")


def group_runtime_env(spec: dict[str, Any] | None, group: str) -> dict[str, Any] | None:
    """Ray's runtime_env of one worker group from ``run.ray_runtime_envs.<group>``: ``environment: NAME``
    becomes the py_executable of that built environment (an error naming the build command when it is not
    built); the other keys are Ray's own."""
    if not spec:
        return None
    unknown = sorted(set(spec) - set(RUNTIME_ENV_KEYS))
    if unknown:
        raise UsageError(f"run.ray_runtime_envs.{group}: unknown keys {unknown}.",
                         hint=f"Use {', '.join(RUNTIME_ENV_KEYS)}.")
    out = {k: v for k, v in spec.items() if k != "environment"}
    if "environment" in spec:
        if "py_executable" in spec:
            raise UsageError(f"run.ray_runtime_envs.{group}: give 'environment' or 'py_executable', not both.")
        from omnirl_core.serving.envs import component_environment, environment_python

        out["py_executable"] = str(environment_python(component_environment(str(spec["environment"]))))
    if "py_executable" in out and not Path(str(out["py_executable"]).split()[0]).exists():
        raise UsageError(f"run.ray_runtime_envs.{group}.py_executable: {out['py_executable']} does not exist.",
                         hint="Point it at the python of a virtual environment that has omnirl and the run's plugins.")
    return out


def actor_runtime_env(run: Any, group: str, environment: str | None = None) -> dict[str, Any]:
    """The runtime_env of one of the run's actors: its group's (``run.ray_runtime_envs``; where the run gives
    none, ``environment``: the environment the group's components need, e.g. a train engine's), with
    ``RAY_worker_niceness`` from ``run.ray_worker_niceness``, which the worker's Ray core reads when it starts (a
    value in the group's own env_vars wins)."""
    spec = run.ray_runtime_envs.get(group) or ({"environment": environment} if environment else None)
    runtime_env = group_runtime_env(spec, group) or {}
    if run.ray_worker_niceness is not None:
        runtime_env["env_vars"] = {"RAY_worker_niceness": str(run.ray_worker_niceness),
                                   **runtime_env.get("env_vars", {})}
    return runtime_env


def served_rewards() -> type[ServedRewards]:
    """``ray_serve_rewards.ServedRewards``: Ray Serve, imported (after Ray: ``loopback_only`` comes first), or a
    usage error that says what to install."""
    try:
        from omnirl_core.loop.ray_serve_rewards import ServedRewards
    except ImportError as exc:
        raise UsageError(f"run.reward_serving=serve needs Ray Serve, which this environment lacks: {exc}.",
                         hint='Install it on the driver and on every node: pip install "ray[serve]" (the same '
                              "version as ray), or set run.reward_serving=actors.") from exc
    return ServedRewards


def _actor_resources(resource: str, cpus: float) -> dict[str, Any]:
    """Ray actor options for one worker on a device whose Ray resource is ``resource``."""
    if resource == "CPU":
        return {"num_cpus": cpus}
    if resource == "GPU":
        return {"num_cpus": cpus, "num_gpus": 1}
    return {"num_cpus": cpus, "resources": {resource: 1}}


def _bundle(options: dict[str, Any]) -> dict[str, float]:
    bundle = {"CPU": options.get("num_cpus", 0)}
    if options.get("num_gpus"):
        bundle["GPU"] = options["num_gpus"]
    bundle.update(options.get("resources", {}))
    return {k: v for k, v in bundle.items() if v}


class RayExecutor(Executor):
    name = "ray"

    def __init__(self, resolved: ResolvedRun):
        self.resolved = resolved
        run = resolved.config.run
        if run.placement == "colocated" and run.train_workers > 1:
            raise UsageError(
                f"run.train_workers={run.train_workers} needs run.placement=split: a colocated rollout would "
                "have to run on every sharded rank.",
                hint="Set run.placement=split (a separate rollout worker, weights synced after each update).",
            )
        engine_cls = cast("type[TrainEngine]", resolved.train_engine.load_factory())  # a train engine's factory
        if run.train_workers > 1 and not engine_cls.distributed:
            raise UsageError(
                f"Train engine '{resolved.train_engine.name}' runs in one process; run.train_workers="
                f"{run.train_workers} needs a distributed engine.",
                hint="Set train.engine=fsdp2, or run.train_workers=1.",
            )
        self.colocated = run.placement == "colocated"
        if self.colocated and "rollout" in run.ray_pools:
            raise UsageError("run.ray_pools.rollout is set, but with run.placement=colocated the rollout runs in the "
                             "train worker (run.ray_pools.train places it).",
                             hint="Set run.placement=split, or move the entry to run.ray_pools.train.")
        self.train: list[Any] = []
        self.train_environment: str | None = None  # set up: the environment the train workers run in
        self.rollout_worker: Any = None
        self.reference_worker: Any = None
        self.reward_actors: list[Any] = []
        self.served: ServedRewards | None = None
        """run.reward_serving=serve: the rewards' Serve deployment (``setup``), instead of ``reward_actors``."""
        self.reward_coalesce = 0  # set in setup: samples per coalesced reward call (RewardActor.batch_capacity)
        self.reward_batching = False  # set in setup: run.reward_batching, or rewards that are batch-invariant
        self.pools: list[Any] = []
        self._started_ray = False
        self.hold = False  # the colocated worker keeps the trajectories (``setup``)
        self.eval_weights_differ = False  # the algorithm evaluates other weights than it trains (an EMA)
        self.address: str | None = None
        self.address_source = "local"
        self.placement = Placement()
        self.traffic: dict[str, Any] = {}
        """Bytes the last checkpoint moved: ``checkpoint_bytes`` (workers -> driver; ``checkpoint_bytes_by_rank``),
        ``restore_bytes`` (driver -> workers, on resume); with run.storage ``stored_bytes`` (workers -> storage;
        ``stored_bytes_by_rank``) and ``restore_bytes`` (storage -> workers)."""
        self.storage: str | None = None
        """run.storage, as every node sees it (a local path made absolute): where the workers write their checkpoint
        files. None: through Ray into the run directory."""
        if run.storage is not None:
            from omnirl_core.rundir.storage import Storage, absolute

            self.storage = Storage(absolute(run.storage)).location  # a scheme this driver cannot open: refused now

    # -- placement -----------------------------------------------------------------------------
    def _connect(self) -> None:
        self.address, self.address_source = cluster_address(self.resolved.config.run.ray_address)
        if self.address is None:
            loopback_only()  # before Ray is imported: it reads the switch then
        import ray

        if ray.is_initialized():
            return
        # the thread policy's wait setting (omnirl_core.host.threads) goes to the workers too; each actor sizes
        # torch's pools to the CPUs Ray assigned it (threads.configure)
        env = {k: v for k, v in os.environ.items()
               if k.startswith(("OMNIRL_", "HF_")) or k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
        runtime_env = {"env_vars": env} if env else None
        if self.address is None:
            before = ray_watchdog.children()
            # "local": a new instance of this run's own, never one that `ray start` left on this machine
            ray.init(address="local", include_dashboard=False, dashboard_host="127.0.0.1", runtime_env=runtime_env)
            ray_watchdog.start(before)  # the local instance goes with this process, kill -9 included
        else:
            join(self.address, self.address_source, runtime_env)
        self._started_ray = True

    def _pool(self, pool: Pool) -> Any:
        import ray
        from ray.util.placement_group import placement_group

        placed = placement_group(pool.bundles, strategy=pool.ray_strategy,
                                 name=f"omnirl-{pool.group}-{os.getpid()}-{id(self)}")
        self.pools.append(placed)
        ready, _ = ray.wait([placed.ready()], timeout=POOL_TIMEOUT_S)
        if not ready:
            raise UsageError(
                f"Ray could not place the {pool.group} pool ({pool.bundles}, {pool.strategy}) within "
                f"{POOL_TIMEOUT_S:.0f} s.",
                details=[f"Cluster resources: {ray.cluster_resources()}",
                         f"Available now: {ray.available_resources()}"],
                hint="Lower run.worker_cpus / run.reward_workers / run.train_workers, relax run.ray_pools, or add "
                     "resources (another job may hold them).",
            )
        return placed

    def _place(self, cls: Any, pool: Any, index: int, options: dict[str, Any], *args: Any,
               group: str = "") -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=pool, placement_group_bundle_index=index)
        runtime_env = actor_runtime_env(self.resolved.config.run, group,
                                        self.train_environment if group == "train" else None)
        if runtime_env:
            options = {**options, "runtime_env": runtime_env}
        # never restarted, no call retried: a worker that came back would have lost the run's state (its weights,
        # optimizer, held trajectories); a lost worker stops the run instead (WorkerLostError)
        options = {**options, "max_restarts": 0, "max_task_retries": 0}
        return ray.remote(cls).options(scheduling_strategy=strategy, **options).remote(*args)

    def setup(self) -> None:
        import ray

        from omnirl_core.loop.worker import build_algorithm
        from omnirl_core.serving.envs import worker_environment

        r = self.resolved
        # a train engine with an environment of its own: the train workers run there
        needed = worker_environment(r.train_engine)
        self.train_environment = needed.name if needed is not None else None
        self._connect()
        run = r.config.run
        resource = r.device.ray_resource if r.device else "CPU"
        worker_opts = _actor_resources(resource, run.worker_cpus)
        train_roles = ["actor", "rollout"] if self.colocated else ["actor"]
        algorithm = build_algorithm(r)
        separate_reference = reference_placement(r, algorithm) == "separate"
        self.eval_weights_differ = algorithm.has_eval_policy
        # the colocated worker keeps the trajectories it made when nothing else needs them: the controller's side
        # of the algorithm reads none and no reference worker evaluates the units
        self.hold = self.colocated and not separate_reference and not algorithm.controller_reads_trajectory
        reward_opts = self._reward_options()
        serving = run.reward_serving == "serve"
        if serving:
            served_rewards()  # Ray Serve importable here, before anything is placed
        worker = _bundle(worker_opts)
        pools = {
            "train": group_pool("train", worker, run.train_workers, run.ray_pools.get("train")),
            "rollout": group_pool("rollout", worker, 0 if self.colocated else 1, run.ray_pools.get("rollout")),
            "reference": group_pool("reference", worker, int(separate_reference), run.ray_pools.get("reference")),
            # served: the replicas Serve starts with (their bundle is the pool's; Serve places them)
            "reward": group_pool("reward", _bundle(reward_opts),
                                 run.reward_serve.min_replicas if serving else run.reward_workers,
                                 run.ray_pools.get("reward")),
        }
        check_pools(list(pools.values()), cluster_nodes())
        self._check_capacity({name: pool.bundles for name, pool in pools.items()})
        actors: list[tuple[str, int, Any]] = []
        train_pool = self._pool(pools["train"])
        self.train = [self._place(WorkerActor, train_pool, rank, worker_opts, r, train_roles, rank,
                                  run.train_workers, group="train") for rank in range(run.train_workers)]
        actors += [("train", rank, a) for rank, a in enumerate(self.train)]
        if self.colocated:
            self.rollout_worker = self.train[0]
        else:
            rollout_pool = self._pool(pools["rollout"])
            self.rollout_worker = self._place(WorkerActor, rollout_pool, 0, worker_opts, r, ["rollout"], 0, 1,
                                              group="rollout")
            actors.append(("rollout", 0, self.rollout_worker))
        if separate_reference:
            reference_pool = self._pool(pools["reference"])
            self.reference_worker = self._place(WorkerActor, reference_pool, 0, worker_opts, r, ["reference"], 0, 1,
                                                group="reference")
            actors.append(("reference", 0, self.reference_worker))
        if not serving:
            reward_pool = self._pool(pools["reward"])
            # an async actor: the driver keeps a reward without submit to reward_concurrency calls at once (its
            # threads); a reward with submit takes every call, bounded by its own capacity
            actor_opts = {**reward_opts, "max_concurrency": max(run.reward_concurrency, ASYNC_ACTOR_CALLS)}
            self.reward_actors = [self._place(RewardActor, reward_pool, i, actor_opts, r, group="reward")
                                  for i in range(run.reward_workers)]
            actors += [("reward", i, a) for i, a in enumerate(self.reward_actors)]
        self._locate(actors)
        if serving:  # after the pools: the replicas take what the placement groups left
            self._serve_rewards(pools["reward"])
        with self._guard("setup"):
            if run.train_workers > 1:  # the group's rendezvous: rank 0's node address, a free port there
                address, port = ray.get(self.train[0].address.remote())
                backend = r.device.backend if r.device else "gloo"
                self.placement.gather([w.init_group.remote(backend, address, port) for w in self.train], "setup")
            if self.served is not None:  # one request per sample; the replicas batch (or not) by themselves
                self.reward_batching = bool(self.served.replica_settings()["batched"])
            else:
                self.reward_coalesce = int(ray.get(self.reward_actors[0].batch_capacity.remote()))
                self.reward_batching = run.reward_batching or bool(
                    ray.get(self.reward_actors[0].batch_invariant.remote()))
            members = {(p.group, p.index): p for p in self.placement.placed}
            who = [members[("train", rank)] for rank in range(len(self.train))]
            if not self.colocated:
                who.append(members[("rollout", 0)])
            if self.reference_worker is not None:
                who.append(members[("reference", 0)])
            self.placement.gather([w.setup.remote() for w in self._workers()], "set up", who)
            if not self.colocated:
                self.sync_weights()  # the rollout worker starts from the actor's exact weights

    def _serve_rewards(self, pool: Pool) -> None:
        """run.reward_serving=serve: the rewards' Serve deployment, its replicas with the reward pool's bundle and
        strategy and the reward group's runtime environment; the replicas that answered at start join the run's
        placement (``runtime.json``, a lost node), their versions checked against the driver's."""
        runtime_env = actor_runtime_env(self.resolved.config.run, "reward") or None
        self.served = served_rewards()(self.resolved, pool.bundles[0], pool.strategy, runtime_env)
        reports = self.served.deploy()
        self.placement.placed.extend(placed for placed, _ in reports)
        log.info("ray: reward (Serve application %s) on %s", self.served.app,
                 ", ".join(f"{p.ip} ({p.node_id[:8]})" for p, _ in reports))

    def _watch(self, phase: str) -> None:
        """Raises a ``WorkerLostError`` when a node of the run has died (called while the driver waits)."""
        dead = self.placement.dead()
        if dead:
            raise self.placement.lost_on(dead[0], phase, "the node was declared dead while the driver waited")

    def _locate(self, actors: list[tuple[str, int, Any]]) -> None:
        """Where each actor runs (``runtime.json``), and the check that its node runs the driver's omnirl and plugin
        versions, before any model loads. An actor that could not start is named with its node."""
        import ray
        from ray.exceptions import RayActorError

        modules = run_modules(self.resolved)
        calls = [(group, index, actor, actor.where.remote(modules)) for group, index, actor in actors]
        reports = []
        for group, index, actor, call in calls:
            try:
                location, versions = ray.get(call)
            except RayActorError as exc:
                raise UsageError(f"The {group} worker {index} of the run could not start on its Ray node.",
                                 details=[str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)],
                                 hint="Check that node's environment (omnirl and the run's plugins installed, the "
                                      "model reachable); --debug shows the worker's traceback.") from exc
            placed = Placed(group, index, **location)
            self.placement.placed.append(placed)
            reports.append((placed, versions))
        check_versions(installed_versions(modules), reports)
        for group, members in self.placement.groups().items():
            log.info("ray: %s on %s", group, ", ".join(f"{m['ip']} ({m['node_id'][:8]})" for m in members))

    def runtime(self) -> dict[str, Any]:
        """``runtime.json``'s ``ray``: the cluster joined, its nodes, and the node of every actor of each group."""
        if not self.placement.placed:
            return {}
        ours = {p.node_id for p in self.placement.placed}
        nodes = [{"node_id": n.node_id, "ip": n.ip, "hostname": n.hostname, "head": n.head,
                  "resources": {k: v for k, v in n.resources.items() if not k.startswith("node:")}}
                 for n in cluster_nodes() if n.node_id in ours]
        record = {"address": self.address or "local", "address_from": self.address_source, "nodes": nodes,
                  "groups": self.placement.groups()}
        if self.served is not None:
            record["reward_serve"] = self.served.runtime()
        return {"ray": record}

    @contextmanager
    def _guard(self, phase: str) -> Iterator[None]:
        """A failure of the run's workers in ``phase``: a ``WorkerLostError`` when a worker was lost (its node, or
        its process), else the failure as it is. A broken collective of the train ranks (a peer that vanished) is
        a suspect: Ray is given time to declare the node dead before the error is taken as it is."""
        from ray.exceptions import RayTaskError

        try:
            yield
        except WorkerLostError:
            raise  # named already (a phase inside this one)
        except Exception as exc:
            suspect = len(self.train) > 1 and isinstance(exc, RayTaskError) and isinstance(exc.cause, RuntimeError)
            lost = self.placement.explain(exc, phase, suspect=suspect) if self.placement.placed else None
            if lost is None:
                raise
            raise lost from exc

    def _check_capacity(self, pools: dict[str, list[dict[str, float]]]) -> None:
        """Fail at once, with the arithmetic, when the pools need more than the whole cluster has (placing
        them would wait for resources that never come)."""
        import ray

        total: dict[str, float] = {}
        for bundles in pools.values():
            for bundle in bundles:
                for key, value in bundle.items():
                    total[key] = total.get(key, 0.0) + value
        have = ray.cluster_resources()
        short = {k: v for k, v in total.items() if v > have.get(k, 0.0) + 1e-9}
        if short:
            run = self.resolved.config.run
            raise UsageError(
                "The Ray cluster is too small for this run's worker pools: "
                + ", ".join(f"{k} {total[k]:g} needed, {have.get(k, 0.0):g} in the cluster" for k in short) + ".",
                details=[f"{name}: {len(bundles)} x {bundles[0]}" for name, bundles in pools.items() if bundles],
                hint=f"Lower run.worker_cpus ({run.worker_cpus:g}) or run.reward_workers ({run.reward_workers}), "
                     "use run.placement=colocated or run.reference=actor, or add resources.",
            )

    def _reward_options(self) -> dict[str, Any]:
        """Each reward actor reserves the most any of the run's rewards declares (0.5 CPU by default)."""
        need: dict[str, float] = {"CPU": 0.5}
        for spec in self.resolved.rewards:
            for key, value in spec.resources.items():
                need[key] = max(need.get(key, 0.0), float(value))
        options: dict[str, Any] = {"num_cpus": need.pop("CPU")}
        if "GPU" in need:
            options["num_gpus"] = need.pop("GPU")
        if need:
            options["resources"] = need
        return options

    def _workers(self) -> list[Any]:
        workers = self.train if self.colocated else [*self.train, self.rollout_worker]
        return [*workers, self.reference_worker] if self.reference_worker is not None else workers

    # -- the step ------------------------------------------------------------------------------
    def rollout(self, requests: list[GenRequest], evaluation: bool = False) -> tuple[list[Sample], dict[str, float]]:
        """``evaluation``: sample with the weights the algorithm evaluates (``Algorithm.eval_policy``); a
        separate rollout worker gets them for this rollout and the rollout weights back after it."""
        import ray

        if evaluation and not self.colocated and self.eval_weights_differ:
            self.sync_weights(evaluation=True)
            try:
                return self.rollout(requests)
            finally:
                self.sync_weights()
        with self._guard("evaluation" if evaluation else "rollout"):
            mode = self.resolved.config.run.reward_mode
            start = time.perf_counter()
            run = self.resolved.config.run
            dispatch = _ServeDispatch(self.served) if self.served is not None else _RewardDispatch(
                self.reward_actors, run.reward_concurrency, self.reward_batching, coalesce=self.reward_coalesce)
            hold = self.hold and not evaluation  # an evaluation rollout has no update to hand them back to
            stream = self.rollout_worker.generate.options(num_returns="streaming").remote(requests, evaluation, hold)
            views, refs = consume_stream(stream, dispatch, hold, mode == "async")
            rollout_end = time.perf_counter()
            if mode == "sync" and self.served is not None:  # a request per sample: the replicas batch them
                dispatch.send(views)
            elif mode == "sync":  # one chunk per call slot (actors x the calls each serves at once); coalescing: per actor
                size = int(-(-len(views) // (len(self.reward_actors) if dispatch.coalesce else dispatch.slots))) \
                    if views else 1  # an int: ``slots`` is infinite only when coalescing
                for i in range(0, len(views), size):
                    dispatch.send(views[i:i + size])
            else:
                dispatch.drain()
            calls = dispatch.calls
            samples: list[Sample] = ray.get(refs)
            results = self.served.results(calls, lambda: self._watch("rollout")) if self.served is not None \
                else self.placement.gather(calls, "rollout")
        end = time.perf_counter()
        scores = [item for result in results for item in result[0]]
        for sample, (rewards, total) in zip(samples, scores):
            sample.rewards, sample.reward = rewards, total
        return samples, {"time/rollout_s": rollout_end - start, "time/reward_s": end - rollout_end,
                         "time/reward_busy_s": sum(busy for _, busy in results), "time/reward_calls": float(len(calls))}

    def update(self, units: list[Any], step: int) -> dict[str, float]:
        """Every rank gets the units (one copy in the object store) and runs its own algorithm instance,
        built from the same config; metrics are reduced across ranks by the engine."""
        import ray

        with self._guard("update"):
            ref = ray.put(shed_outputs(units) if self.hold else units)
            reference = None
            if self.reference_worker is not None:  # computed beside the actor's own pass, sent to every rank
                reference = [self.reference_worker.reference_outputs.remote(ref)]
            return self.placement.gather([w.update.remote(ref, step, reference) for w in self.train], "update")[0]

    def set_old_logprob(self, mode: str) -> None:
        with self._guard("update"):
            self.placement.gather([w.set_old_logprob.remote(mode) for w in self.train], "update")

    def sync_weights(self, evaluation: bool = False) -> dict[str, float]:
        if self.colocated:
            return {}
        with self._guard("weight sync"):
            states = [w.trained_state.remote(evaluation) for w in self.train]  # a collective on sharded ranks
            # the rollout worker fetches rank 0's weights from its node: they do not pass through the driver
            moved = self.placement.gather([self.rollout_worker.load_trained_state.remote(states[0]), *states[1:]],
                                          "weight sync")[0]
        return {"sync/bytes": float(moved)}

    # -- checkpoints ---------------------------------------------------------------------------
    def save_state(self, directory: Path) -> list[str]:
        """The workers' part of a checkpoint: every train rank writes its files (shards, for a sharded engine) on
        its own node and streams them here, into ``directory``; each file's SHA-256 is checked on arrival. With
        run.storage they go to the storage instead (``_save_stored``)."""
        import ray

        if self.storage is not None:
            return self._save_stored(directory)
        with self._guard("checkpoint"):
            streams = [w.save_state.options(num_returns="streaming", _generator_backpressure_num_objects=IN_FLIGHT)
                       .remote() for w in self.train]
            listed = self._first_items(streams)  # a sharded save's collectives are over once every rank has one
            receiver = Receiver(directory)
            by_rank = []
            try:
                for stream in streams:
                    before = receiver.bytes
                    for ref in stream:
                        receiver.take(ray.get(ref))
                    by_rank.append(receiver.bytes - before)
            finally:
                receiver.close()
        self.traffic.update(checkpoint_bytes=receiver.bytes, checkpoint_bytes_by_rank=by_rank)
        return sorted({f for part in listed for f in part})

    def _save_stored(self, directory: Path) -> list[str]:
        """run.storage: every train rank writes its part on its node, then copies its own files to
        ``<storage>/checkpoints/step-N-<id>/`` (a file several ranks wrote, from the lowest of them); the driver
        writes the stored directory's manifest there and ``storage.json`` (where, and each file's SHA-256
        and size) into ``directory``. A save that fails removes what it stored."""
        from omnirl_core.rundir.checkpoint import stored_name
        from omnirl_core.rundir.storage import STORAGE_FILE, STORED_MANIFEST, Storage, record, stored_manifest

        assert self.storage is not None
        storage = Storage(self.storage)
        target = f"checkpoints/{stored_name(directory)}"
        with self._guard("checkpoint"):
            staged = self.placement.gather([w.stage_state.remote() for w in self.train], "checkpoint")
            mine = owners([sums for _, sums in staged])
            try:
                stored = self.placement.gather([w.store_state.remote(self.storage, target, names)
                                                for w, names in zip(self.train, mine)], "checkpoint")
                files: dict[str, tuple[str, int]] = {}
                for rank, part in enumerate(stored):
                    for name, (sha, size) in part.items():
                        if staged[rank][1][name][0] != sha:
                            raise TransferError(f"train rank {rank} stored checkpoint file {name} with SHA-256 {sha}, "
                                                f"but wrote it with {staged[rank][1][name][0]}")
                        files[name] = (sha, size)
                storage.write_bytes(stored_manifest(files), target, STORED_MANIFEST)
            except BaseException:
                storage.remove(target)
                raise
        (directory / STORAGE_FILE).write_text(json.dumps(record(self.storage, target, files), indent=2))
        by_rank = [sum(size for _, size in part.values()) for part in stored]
        self.traffic.update(checkpoint_bytes=0, checkpoint_bytes_by_rank=[0] * len(by_rank),
                            stored_bytes=sum(by_rank), stored_bytes_by_rank=by_rank)
        return sorted({f for listed, _ in staged for f in listed})

    def _first_items(self, streams: list[Any]) -> list[Any]:
        """The first item of each streaming call, failing as soon as one fails or a node of the run dies."""
        import ray

        firsts: dict[int, Any] = {}
        while len(firsts) < len(streams):
            waiting = [s for i, s in enumerate(streams) if i not in firsts]
            ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=POLL_S)
            for stream in ready:
                firsts[streams.index(stream)] = ray.get(next(stream))
            dead = self.placement.dead() if len(firsts) < len(streams) else []
            if dead:
                raise self.placement.lost_on(dead[0], "checkpoint", "the node was declared dead while the driver "
                                             "waited")
        return [firsts[i] for i in range(len(streams))]

    def load_state(self, directory: Path) -> None:
        """Each train rank gets its part of the (verified) checkpoint ``directory`` through Ray, the files of the
        other ranks of a sharded engine left out; or, for a checkpoint whose files are stored (``storage.json``,
        wherever run.storage now points), fetches it from the storage itself."""
        from omnirl_core.rundir.checkpoint import stored_entry

        world = len(self.train)
        entry = stored_entry(directory)
        if entry is not None:
            self._load_stored(directory, entry)
        else:
            names = files_in(directory)
            shipped = {s.name: s for s in ship(directory, names)}
            with self._guard("checkpoint load"):
                parts = [[shipped[n] for n in rank_part(names, rank, world)] for rank in range(world)]
                moved = self.placement.gather([w.load_state.remote(part) for w, part in zip(self.train, parts)],
                                              "checkpoint load")
            del shipped, parts  # the chunks leave the object store
            self.traffic["restore_bytes"] = sum(moved)
        if not self.colocated:
            self.sync_weights()

    def _load_stored(self, directory: Path, entry: dict[str, Any]) -> None:
        """Each train rank fetches its part of a stored checkpoint from the storage (the other ranks' shards left
        out, as through Ray) and checks each file's SHA-256 against ``storage.json``; a damaged or missing file is
        a ``StorageError`` naming it (exit code 2)."""
        from omnirl_core.rundir.checkpoint import fallback_hint
        from omnirl_core.rundir.storage import STORAGE_FILE, StorageError

        names = sorted(entry["files"])
        world = len(self.train)
        manifest = str(directory / STORAGE_FILE)
        try:
            with self._guard("checkpoint load"):
                moved = self.placement.gather([w.fetch_state.remote(entry, rank_part(names, rank, world), manifest)
                                               for rank, w in enumerate(self.train)], "checkpoint load")
        except StorageError as err:
            err.hint = (f"Restore the file in the storage location (it is the checkpoint's only copy), or: "
                        f"{fallback_hint(directory)}")
            raise
        self.traffic["restore_bytes"] = sum(moved)

    def close(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        if self.served is not None:  # Serve first: its replicas and controller go before Ray does
            self.served.close()
            self.served = None
        for actor in [*self._workers(), *self.reward_actors]:
            if actor is not None:
                ray.kill(actor)
        for pool in self.pools:
            ray.util.remove_placement_group(pool)
        self.train, self.reward_actors, self.pools, self.reference_worker = [], [], [], None
        if self._started_ray:
            ray.shutdown()
