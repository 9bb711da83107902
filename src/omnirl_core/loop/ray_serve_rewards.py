"""The run's rewards as a Ray Serve deployment (``run.reward_serving=serve``, the Ray executor only).

Instead of ``run.reward_workers`` plain reward actors, the driver deploys one Serve application of its own (named
after its process, so that runs sharing a cluster never meet) with one deployment, ``rewards``, whose replicas each
hold the run's rewards (``RewardSet``), as a reward actor does:

- **placement**: each replica reserves what a reward actor reserves (the most any of the run's rewards declares,
  0.5 CPU at least) plus the reward pool's selector (``run.ray_pools.reward``: custom resources, a node), so it
  goes only to the nodes the pool would take; ``strict_spread`` puts at most one replica on a node;
- **calls**: the driver sends each finished sample as one request through the deployment's handle: the sample's
  object goes from Ray's object store to the replica, as it does to a reward actor; no HTTP (Serve's proxies are
  not started) and no other serialisation;
- **dynamic batching**: where every reward is ``batch_invariant`` (a sample's score is the same whatever shares its
  call) or ``run.reward_batching`` allows it, a replica gathers the requests that arrive together into one scoring
  call (``@serve.batch``: up to ``max_batch_size`` samples, waiting at most ``batch_wait_s``); otherwise each
  sample is scored in a call of its own, so that no score depends on timing;
- **autoscaling**: between ``min_replicas`` and ``max_replicas`` (``run.reward_workers`` by default) by the
  requests in flight or queued per replica (``target_ongoing_requests``): samples piling up add replicas.

A required reward that fails in a replica stops the run with the reward's error (its name, ``RewardError``), as on
a reward actor. Serve is shut down when the run ends, fails or is interrupted if the run started it (the
deployment alone is deleted when Serve was running on the cluster before). Replicas hold no state of the run's:
Serve replaces one that fails its health check. The replicas that answer at start join the run's placement
(``runtime.json``, the version check), so that their node dying stops the run as any node of the run does
(``WorkerLostError``); replicas added later are Serve's alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from ray import serve

from omnirl_core.contracts import Sample
from omnirl_core.errors import OmnirlError, UsageError
from omnirl_core.loop.cluster import POLL_S, Placed, check_versions, installed_versions, run_modules
from omnirl_core.loop.executors import build_rewards
from omnirl_core.resolve import ResolvedRun

log = logging.getLogger("omnirl.ray")

DEPLOYMENT = "rewards"
DEFAULT_MAX_BATCH = 16
DEFAULT_BATCH_WAIT_S = 0.01

Scored = tuple[list[tuple[dict[str, float], float]], float]
"""What a reward call answers, as a reward actor's ``score`` does: each sample's (rewards, total), and the busy time."""


class RewardReplica:
    """One replica of the deployment: the run's rewards, scoring one sample a request."""

    def __init__(self, resolved: ResolvedRun, max_batch_size: int, batch_wait_s: float):
        from omnirl_core.host.threads import configure

        configure("fixed")  # torch's pools sized to the CPUs Ray assigned this replica, not to the machine
        self.rewards = build_rewards(resolved)
        run = resolved.config.run
        self.batched = self.rewards.batch_invariant or run.reward_batching
        """Requests are gathered into one scoring call (``score_batch``) only where that changes no score, or the
        user allowed timing-dependent batches."""
        self.score_batch.set_max_batch_size(max_batch_size)
        self.score_batch.set_batch_wait_timeout_s(batch_wait_s)
        # unbatched: as many calls at once as a reward actor serves (threads), or a judge's own capacity
        self.slots = asyncio.Semaphore(max(run.reward_concurrency, self.rewards.batch_capacity))
        self.batch_sizes: list[int] = []

    def where(self, modules: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
        """Where this replica runs and the omnirl / plugin versions its node has (``RewardActor.where``)."""
        return replica_location(), installed_versions(modules)

    def settings(self) -> dict[str, Any]:
        """How this replica scores (for ``runtime.json`` and tests): batched or not, the batch limits."""
        return {"batched": self.batched, "max_batch_size": self.score_batch._get_max_batch_size(),
                "batch_wait_s": self.score_batch._get_batch_wait_timeout_s(), "batch_sizes": list(self.batch_sizes)}

    async def score(self, sample: Sample) -> Scored:
        """One sample's scores (a request); batched with the requests that arrive beside it where allowed."""
        if self.batched:
            scores, busy = await self.score_batch(sample)
            return [scores], busy
        async with self.slots:
            start = time.perf_counter()
            await self.rewards.ascore([sample])
            return [(sample.rewards, sample.reward)], time.perf_counter() - start

    @serve.batch(max_batch_size=DEFAULT_MAX_BATCH, batch_wait_timeout_s=DEFAULT_BATCH_WAIT_S)
    async def score_batch(self, samples: list[Sample]) -> list[tuple[tuple[dict[str, float], float], float]]:
        """The samples of the requests that came together, in one call of the rewards; each request gets its
        sample's scores and its share of the call's time. A required reward that fails fails every request of the
        batch."""
        start = time.perf_counter()
        self.batch_sizes.append(len(samples))
        await self.rewards.ascore(samples)
        share = (time.perf_counter() - start) / len(samples)
        return [((s.rewards, s.reward), share) for s in samples]


def replica_location() -> dict[str, Any]:
    """This replica (its Ray actor id) and where it runs: the node's id and address, the host's name, the pid."""
    import socket

    import ray

    context = ray.get_runtime_context()
    return {"actor_id": context.get_actor_id(), "node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(), "pid": os.getpid()}


def serve_running() -> bool:
    """Whether Ray Serve runs on the connected cluster (its controller, a detached actor, exists)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def actor_options(bundle: dict[str, float]) -> dict[str, Any]:
    """Ray actor options of a replica from its reward-pool bundle (CPU, GPU, custom resources, a node selector)."""
    need = dict(bundle)
    options: dict[str, Any] = {"num_cpus": need.pop("CPU", 0.0)}
    if "GPU" in need:
        options["num_gpus"] = need.pop("GPU")
    if need:
        options["resources"] = need
    return options


class ServedRewards:
    """The driver's side: deploys the application, sends samples as requests, collects the scores, and takes it
    all down again (``close``)."""

    def __init__(self, resolved: ResolvedRun, bundle: dict[str, float], strategy: str,
                 runtime_env: dict[str, Any] | None):
        self.resolved = resolved
        run = resolved.config.run
        self.settings = run.reward_serve
        self.min_replicas = self.settings.min_replicas
        self.max_replicas = self.settings.max_replicas or max(run.reward_workers, self.min_replicas)
        if self.max_replicas < self.min_replicas:
            raise UsageError(f"run.reward_serve.max_replicas ({self.max_replicas}) is less than min_replicas "
                             f"({self.min_replicas}).", hint="Raise run.reward_serve.max_replicas.")
        self.options = actor_options(bundle)
        if runtime_env:
            self.options["runtime_env"] = runtime_env
        self.strategy = strategy
        self.app = f"omnirl-rewards-{os.getpid()}-{id(self):x}"
        self.handle: Any = None
        self.started_serve = False
        self.replicas: list[Placed] = []

    def deployment_config(self) -> dict[str, Any]:
        """The deployment's options (``serve.deployment``): replicas or autoscaling, placement, the requests a
        replica holds."""
        s = self.settings
        config: dict[str, Any] = {"name": DEPLOYMENT, "ray_actor_options": self.options,
                                  "max_ongoing_requests": s.max_ongoing_requests}
        if self.strategy == "strict_spread":
            config["max_replicas_per_node"] = 1
        if self.max_replicas == self.min_replicas:
            config["num_replicas"] = self.min_replicas
        else:
            config["autoscaling_config"] = {
                "min_replicas": self.min_replicas, "initial_replicas": self.min_replicas,
                "max_replicas": self.max_replicas, "target_ongoing_requests": s.target_ongoing_requests,
                "upscale_delay_s": s.upscale_delay_s, "downscale_delay_s": s.downscale_delay_s}
        return config

    def deploy(self) -> list[tuple[Placed, dict[str, str]]]:
        """Starts Serve (without proxies) unless it runs, deploys the application and waits for its replicas; returns
        where the replicas that answered run and their versions (the caller checks them against the driver's)."""
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # not a line per deployment step on the console
        quiet = {"log_level": "WARNING", "enable_access_log": False}  # no log line per request in the replicas
        self.started_serve = not serve_running()
        if self.started_serve:
            serve.start(proxy_location="Disabled", logging_config=quiet)
        app = serve.deployment(RewardReplica).options(**self.deployment_config()).bind(
            self.resolved, self.settings.max_batch_size, self.settings.batch_wait_s)
        try:
            self.handle = serve.run(app, name=self.app, route_prefix=None, logging_config=quiet)
        except RuntimeError as exc:
            raise UsageError(f"The rewards' Ray Serve deployment could not start ({self.min_replicas} replica(s) of "
                             f"{self.options}).", details=[str(exc).strip().splitlines()[-1] if str(exc).strip()
                                                           else repr(exc)],
                             hint="Check the reward nodes' environment (omnirl and the run's plugins installed, the "
                                  "reward's models reachable); --debug shows the replica's traceback.") from exc
        modules = run_modules(self.resolved)
        reports: dict[str, tuple[Placed, dict[str, str]]] = {}
        for index in range(self.min_replicas):
            location, versions = self.handle.where.remote(modules).result()
            if location["actor_id"] not in reports:
                reports[location["actor_id"]] = (Placed("reward", len(reports), **location), versions)
        self.replicas = [placed for placed, _ in reports.values()]
        check_versions(installed_versions(modules), list(reports.values()))
        return list(reports.values())

    def replica_settings(self) -> dict[str, Any]:
        return self.handle.settings.remote().result()

    def send(self, view: Any) -> Any:
        """One sample (its object ref from the rollout's stream) as one request: the replica fetches it from the
        object store."""
        return self.handle.score.remote(view)

    def results(self, responses: list[Any], watch: Callable[[], None]) -> list[Scored]:
        """The answers of ``responses``, in order; ``watch`` runs while the driver waits (it raises when a node of the
        run died). A failure in a replica raises the reward's own error (a required reward's ``RewardError``)."""
        from ray.exceptions import RayTaskError

        out = []
        for response in responses:
            while True:
                try:
                    out.append(response.result(timeout_s=POLL_S))
                    break
                except TimeoutError:
                    watch()
                except RayTaskError as exc:
                    if isinstance(exc.cause, OmnirlError):
                        raise exc.cause from exc
                    raise
        return out

    def runtime(self) -> dict[str, Any]:
        """``runtime.json``'s ``reward_serve``: the application, its deployment's settings, the replicas at start."""
        return {"application": self.app, "deployment": DEPLOYMENT, "started_serve": self.started_serve,
                "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "ray_actor_options": {k: v for k, v in self.options.items() if k != "runtime_env"},
                "replicas_at_start": [{"node_id": p.node_id, "ip": p.ip, "actor_id": p.actor_id}
                                      for p in self.replicas]}

    def close(self) -> None:
        """Takes the application down: Serve itself when this run started it (its controller goes too), else only
        this run's application. Errors are logged, never raised (this runs while a failure propagates)."""
        try:
            if self.started_serve:
                serve.shutdown()
            elif self.handle is not None:
                serve.delete(self.app)
        except Exception as exc:  # noqa: BLE001 - closing after a failure must not hide it
            log.warning("could not shut Ray Serve's reward application %s down: %s", self.app, exc)
        self.handle = None
