"""omnirl on a Ray cluster of several nodes (issue 32), on a local cluster of real raylets: a head and two worker
nodes of 1 CPU each (``ray.cluster_utils.Cluster``), each with its own temp directory and its own working
directory, under token authentication (Ray 2.5x's default). The driver is the real ``omnirl train --ray-address``.

No shared run directory: the driver's run directory is relative to the driver's working directory (a worker that
wrote by a path it was given would write into its own node's working directory, which the test inspects), and every
node's Python processes carry an audit hook (a ``sitecustomize`` on the node's PYTHONPATH, a test double for a node
whose disk is not the driver's) that records and refuses any file operation under the driver's run directories. Native
writers (safetensors) bypass audit hooks; the relative run directory catches those.

One scenario carries most of it, since each run costs most of a minute on two cores: the tiny FlowGRPO run with the
rollout on the head, two FSDP2 ranks on the two worker nodes (strict_spread) and the reward beside rank 1, its
checkpoints in a storage location of their own (``run.storage``, a ``file://`` URI: the ranks write their files
there, the driver's run directory records where); the node of rank 0 is killed once checkpoint 1 is written; the run
stops with exit code 1 within a bound, naming the node, the group and the checkpoint, leaving nothing half-written;
a node with the same resources joins and the same command resumes, each rank fetching its part from the storage.
Checkpoint 1 (written over three nodes) and the resumed run's final weights and metrics equal the single-node Ray
run's bit for bit (1 torch thread per worker), whose checkpoints reach its run directory through Ray. The same
transfer through Ray between nodes (a worker's files streamed to the driver and shipped back) has a test of its own.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from .conftest import run_cli

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster

FAST_HEALTH_CHECKS = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                      "health_check_timeout_ms": 500, "health_check_initial_delay_ms": 0}
"""Ray declares a lost node dead after about 1.5 s here (about 15 s with its defaults)."""
LOSS_BOUND_S = 60.0
TRAIN = ("train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny", "--reward", "color",
         "--steps", "2", "--device", "cpu", "--executor", "ray",
         "--set", "model.lora.rank=4", "--set", "model.lora.alpha=4",
         "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4", "--set", "rollout.num_steps=3",
         "--set", "rollout.height=32", "--set", "rollout.width=32",
         "--set", "train.engine=fsdp2", "--set", "train.lr=0.01", "--set", "train.minibatches=2",
         "--set", "train.micro_batch_size=8",
         "--set", "run.seed=11", "--set", "run.placement=split", "--set", "run.train_workers=2",
         "--set", "run.worker_cpus=0.5", "--set", "run.threads=1", "--set", "run.save_every=1",
         "--set", "run.eval_every=2", "--set", "run.eval_prompts=2", "--set", "run.eval_samples=1")
POOLS = ("--set", "run.ray_pools.rollout.resources.rollout=0.001",
         "--set", "run.ray_pools.train.strategy=strict_spread", "--set", "run.ray_pools.train.resources.train=0.001",
         "--set", "run.ray_pools.reward.resources.reward=0.001")
VOLATILE = ("time/", "images_per_s", "threads/", "rollout/threads", "eval/time")

SITECUSTOMIZE = '''
import os, sys

_ROOT = os.environ["OMNIRL_TEST_DRIVER_DIR"]
_LOG = os.environ["OMNIRL_TEST_VIOLATIONS"]
_EVENTS = {"open", "os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.listdir", "os.scandir",
           "os.truncate", "os.link", "os.symlink", "os.chmod", "shutil.rmtree", "shutil.copyfile", "shutil.move"}


def _guard(event, args):
    if event not in _EVENTS or not args or args[0] is None or isinstance(args[0], int):
        return
    try:
        path = os.path.abspath(os.fsdecode(args[0]))
    except Exception:
        return
    if path == _ROOT or path.startswith(_ROOT + os.sep):
        with open(_LOG, "a") as log:
            log.write(f"{os.getpid()} {event} {path}\\n")
        raise PermissionError(f"a Ray worker touched the driver's directory: {event} {path}")


sys.addaudithook(_guard)
open(os.path.join(os.environ["OMNIRL_TEST_ARMED"], str(os.getpid())), "w").close()  # this process is watched
'''


class LocalCluster:
    """The module's cluster: node handles by name, their working directories, the driver's directory."""

    def __init__(self, base: Path, token: str):
        self.base, self.token = base, token
        self.driver = base / "driver"
        self.runs = self.driver / "runs"  # the run directories (the driver's cwd itself is on the workers' sys.path:
        self.runs.mkdir(parents=True)     # Ray puts it there, and their imports list it)
        self.violations = base / "violations.log"
        self.armed = base / "armed"  # a file per process of the nodes that carries the audit hook, named by its pid
        self.armed.mkdir()
        self.site = base / "site"
        self.site.mkdir()
        (self.site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.nodes: dict[str, object] = {}
        self.cluster = Cluster(initialize_head=False, shutdown_at_exit=True)
        self.add("head", {"rollout": 1}, head=True)
        self.add("a", {"train": 1})
        self.add("b", {"train": 1, "reward": 1})

    def env(self, **extra: str) -> dict[str, str]:
        return {"PYTHONPATH": str(self.site), "OMNIRL_TEST_DRIVER_DIR": str(self.runs),
                "OMNIRL_TEST_VIOLATIONS": str(self.violations), "OMNIRL_TEST_ARMED": str(self.armed), **extra}

    def add(self, name: str, resources: dict[str, float], head: bool = False, env: dict[str, str] | None = None):
        """A node of 1 CPU with its own temp directory, started in its own working directory (its workers' cwd)."""
        cwd = self.cwd(name)
        cwd.mkdir(parents=True)
        args = {"num_cpus": 1, "resources": resources, "temp_dir": str(self.base / f"t-{name}"),
                "env_vars": env or self.env()}
        if head:
            args["_system_config"] = FAST_HEALTH_CHECKS
        here = os.getcwd()
        os.chdir(cwd)
        try:
            node = self.cluster.add_node(**args)
        finally:
            os.chdir(here)
        self.nodes[name] = node
        return node

    def cwd(self, name: str) -> Path:
        return self.base / "nodes" / name

    def node_id(self, name: str) -> str:
        return self.nodes[name].node_id  # type: ignore[attr-defined]

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)  # the raylet and its workers, SIGKILL

    def train(self, *args: str, env: dict[str, str] | None = None, timeout: int = 420):
        return run_cli(*TRAIN, "--ray-address", self.cluster.address, *args, env=env, cwd=self.driver,
                       timeout=timeout)


@pytest.fixture(scope="module")
def cluster():
    base = Path(tempfile.mkdtemp(prefix="orl-", dir="/tmp"))  # short: Ray's socket paths live below it
    (base / "rt" / "ray").mkdir(parents=True)
    token = secrets.token_hex(16)
    with pytest.MonkeyPatch.context() as env:
        # the cluster's address file in a directory of its own (not /tmp/ray, where other Ray users look);
        # token authentication on, the token in the environment of the nodes and of the drivers started here
        env.setenv("RAY_TMPDIR", str(base / "rt"))
        env.setenv("RAY_AUTH_MODE", "token")
        env.setenv("RAY_AUTH_TOKEN", token)
        env.delenv("RAY_ADDRESS", raising=False)
        _reread_ray_config()  # this process imported Ray before: its cached settings say no authentication
        try:
            local = LocalCluster(base, token)
            try:
                yield local
            finally:
                local.cluster.shutdown()
        finally:
            shutil.rmtree(base, ignore_errors=True)
    _reread_ray_config()  # the session's other Ray tests as they were


def _reread_ray_config() -> None:
    """Make this process's Ray read RAY_AUTH_MODE / RAY_AUTH_TOKEN again (what ``ray.init`` itself does when it
    turns token authentication on)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _steady(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


WEIGHTS = ["pytorch_lora_weights.safetensors", "shards/index.json", "shards/rank-00000-of-00002.safetensors",
           "shards/rank-00001-of-00002.safetensors"]


def _weights(checkpoint: Path) -> dict[str, bytes]:
    """The trained weights and shards of a checkpoint: in its directory, or where its ``storage.json`` says."""
    record = checkpoint / "storage.json"
    if record.is_file():
        entry = json.loads(record.read_text())
        checkpoint = Path(entry["location"].removeprefix("file://")) / entry["directory"]
    return {name: (checkpoint / name).read_bytes() for name in WEIGHTS}


def _stored(storage: Path) -> list[str]:
    return sorted(p.name for p in (storage / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def single_node(cluster, tmp_path_factory) -> Path:
    """The same run on a local Ray instance of one node (no --ray-address; no pools: any node is that node)."""
    out = tmp_path_factory.mktemp("single") / "run"
    proc = run_cli(*TRAIN, "--output-dir", str(out), timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runtime = json.loads((out / "runtime.json").read_text())["ray"]
    assert runtime["address"] == "local" and len(runtime["nodes"]) == 1
    return out


def test_a_node_lost_mid_run_stops_the_run_cleanly_and_the_same_command_resumes_it_exactly(cluster, single_node):
    run = cluster.driver / "runs" / "three-nodes"
    storage = cluster.base / "storage"  # the nodes' shared storage location (one machine's disk here)
    stored = ("--set", f"run.storage=file://{storage}")
    result: dict = {}

    def train() -> None:
        result["proc"] = cluster.train("--output-dir", "runs/three-nodes", *POOLS, *stored)
        result["ended"] = time.monotonic()

    driver = threading.Thread(target=train)
    driver.start()
    first = run / "checkpoints" / "step-000001"
    deadline = time.monotonic() + 400
    while not first.is_dir() and driver.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert first.is_dir(), "checkpoint 1 never appeared"
    runtime = json.loads((run / "runtime.json").read_text())["ray"]
    lost = cluster.node_id("a")
    try:
        cluster.remove("a")  # the node of one train rank (the reward runs on b), during step 2
        killed = time.monotonic()
        driver.join(timeout=400)
    finally:
        cluster.add("a2", {"train": 1})  # the cluster has the resources again
    proc = result["proc"]
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert result["ended"] - killed < LOSS_BOUND_S

    # where each group ran, as asked: rollout on the head, the ranks on the two worker nodes, the reward on b
    groups = {g: [m["node_id"] for m in members] for g, members in runtime["groups"].items()}
    assert runtime["address"] == cluster.cluster.address and runtime["address_from"] == "run.ray_address"
    assert sorted(groups["train"]) == sorted([lost, cluster.node_id("b")])
    assert groups["rollout"] == [cluster.node_id("head")] and groups["reward"] == [cluster.node_id("b")]
    rank = groups["train"].index(lost)

    error = proc.stderr
    assert f"Ray node {runtime['nodes'][0]['ip']} (node {lost[:12]}" in error, error[-3000:]
    assert "during step 2" in error and f"the train group's train rank {rank} ran there" in error, error[-3000:]
    assert f"Last complete checkpoint: {Path('runs/three-nodes/checkpoints/step-000001')}" in error
    assert "resumes from step-000001 exactly" in error and "Traceback" not in error

    # nothing half-written: checkpoint 1 complete and verified, no temporary checkpoint, no checkpoint 2
    from omnirl_core.rundir.checkpoint import verify

    assert verify(first)["step"] == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-000001"]
    # the ranks' files are in the storage, the run directory keeps where they are (no shard, no weights)
    driver_files = ["checksums.json", "metrics.jsonl", "storage.json", "trainer_state.json"]
    assert sorted(p.name for p in first.iterdir()) == driver_files
    entry = json.loads((first / "storage.json").read_text())
    assert entry["location"] == f"file://{storage}" and _stored(storage) == [entry["directory"].split("/")[-1]]
    reference = single_node / "checkpoints" / "step-000001"
    assert sorted(entry["files"]) == sorted(str(f.relative_to(reference)) for f in reference.rglob("*") if f.is_file()
                                            and f.name not in driver_files)  # the layout of a run directory's
    # written over three nodes into the storage: the single-node run's checkpoint (through Ray), bit for bit
    assert _weights(first) == _weights(single_node / "checkpoints" / "step-000001")
    assert not (single_node / "checkpoints" / "step-000001" / "storage.json").exists()

    resumed = cluster.train("--output-dir", "runs/three-nodes", *POOLS, *stored)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resuming run in runs/three-nodes" in resumed.stderr
    final = run / "checkpoints" / "step-000002"
    assert sorted(p.name for p in final.iterdir()) == driver_files and len(_stored(storage)) == 2
    assert _weights(final) == _weights(single_node / "checkpoints" / "step-000002")
    rows, want = _rows(run), _rows(single_node)
    assert [r["step"] for r in rows] == [1, 2]
    assert [_steady(r) for r in rows] == [_steady(r) for r in want]
    assert "eval/reward/mean" in rows[1]  # the evaluation's outputs reached the driver too
    assert (run / "eval" / "step-000002" / "results.json").is_file() and (run / "samples" / "step-000002.png").is_file()
    groups = {g: [m["node_id"] for m in members]
              for g, members in json.loads((run / "runtime.json").read_text())["ray"]["groups"].items()}
    assert sorted(groups["train"]) == sorted([cluster.node_id("a2"), cluster.node_id("b")])

    # the workers never touched the driver's directory, by an absolute path (the audit hook, which every worker of
    # both invocations carried) or a relative one
    pids = {str(m["pid"]) for runtime in (runtime, json.loads((run / "runtime.json").read_text())["ray"])
            for members in runtime["groups"].values() for m in members}
    assert pids <= {p.name for p in cluster.armed.iterdir()}
    assert not cluster.violations.exists(), cluster.violations.read_text()
    for name in ("head", "a", "b", "a2"):
        assert list(cluster.cwd(name).rglob("*")) == [], name


def test_a_node_with_other_plugin_versions_is_refused_with_its_name(cluster, tmp_path):
    """A node whose Python sees another version of the reward's plugin (a fake dist-info first on its PYTHONPATH:
    a test double for a node with another install) is refused at start, before any model loads."""
    fake = tmp_path / "fake-site"
    info = fake / "omnirl_plugin_color-9.9.9.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: omnirl-plugin-color\nVersion: 9.9.9\n")
    (info / "entry_points.txt").write_text("[omnirl.plugins]\ncolor = omnirl_plugin_color\n")
    shutil.copy(cluster.site / "sitecustomize.py", fake / "sitecustomize.py")
    cluster.add("odd", {"odd": 1}, env=cluster.env(PYTHONPATH=str(fake)))
    try:
        # two actors: a colocated worker on the head, the reward on the odd node
        proc = cluster.train("--output-dir", "runs/odd", "--steps", "1", "--set", "run.placement=colocated",
                             "--set", "run.train_workers=1", "--set", "run.ray_pools.train.resources.rollout=0.001",
                             "--set", "run.ray_pools.reward.resources.odd=0.001", timeout=300)
    finally:
        odd = cluster.node_id("odd")
        cluster.remove("odd")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert f"node {odd[:12]}" in proc.stderr and "other omnirl or plugin versions" in proc.stderr
    assert "omnirl-plugin-color: 0.1.0 on the driver, 9.9.9 there" in proc.stderr
    assert "its reward worker 0 runs there" in proc.stderr
    assert not (cluster.driver / "runs" / "odd" / "checkpoints").exists()


def test_a_driver_without_the_clusters_token_is_told_what_is_missing(cluster, tmp_path):
    from omnirl_core.testing.forkserver import run_omnirl

    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home)}
    env.pop("RAY_AUTH_TOKEN")
    proc = run_omnirl([*TRAIN, "--ray-address", cluster.cluster.address, "--output-dir", str(tmp_path / "run"),
                       *POOLS], env=env, cwd=cluster.driver, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"The Ray cluster at {cluster.cluster.address} (run.ray_address) needs token authentication" in proc.stderr
    assert "RAY_AUTH_TOKEN: unset" in proc.stderr and "ray get-auth-token" in proc.stderr


def test_placement_the_nodes_cannot_hold_is_refused_before_anything_is_placed(cluster, tmp_path):
    """strict_spread over three train ranks, and a selector no node has: exit 2, every problem, the nodes listed."""
    proc = cluster.train("--output-dir", str(tmp_path / "run"), "--set", "run.train_workers=3",
                         "--set", "run.ray_pools.train.strategy=strict_spread",
                         "--set", "run.ray_pools.train.resources.train=0.001",
                         "--set", "run.ray_pools.reward.resources.gpu_reward=1", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert "cannot hold this run's worker groups as placed: 2 problem(s)" in err
    assert "run.ray_pools.train.strategy: strict_spread puts each of the 3 train workers on a node of its own, but " \
           "only 2 node(s) have" in err
    assert "run.ray_pools.reward: no node has what one reward worker reserves" in err and "gpu_reward" in err
    assert f"node {cluster.node_id('b')[:12]}" in err


def test_a_workers_failure_is_named_with_its_node_and_a_killed_worker_is_a_lost_one(cluster):
    """``Placement`` on real actors of the cluster: a call that fails while setting up names its worker and node
    (omnirl's own error keeps its message and type); an actor whose process dies on a live node (never restarted) is
    a lost worker, not a failure to retry."""
    from omnirl_core.errors import UsageError
    from omnirl_core.loop.cluster import Placed, Placement, WorkerLostError
    from omnirl_core.loop.ray_executor import actor_location

    @ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0, resources={"reward": 0.001})
    class Stub:
        def where(self):
            return actor_location()

        def missing_weights(self):
            raise FileNotFoundError("/models/qwen-image/model_index.json")

        def bad_setting(self):
            raise UsageError("'/models/qwen-image' is not a diffusers Qwen-Image directory (no model_index.json).")

        def exit_process(self):
            os._exit(1)

    ray.init(address=cluster.cluster.address, log_to_driver=False)
    try:
        stub = Stub.remote()
        placed = Placed("rollout", 0, **ray.get(stub.where.remote()))
        placement = Placement([placed])
        assert placed.node_id == cluster.node_id("b")
        with pytest.raises(UsageError) as caught:
            placement.gather([stub.missing_weights.remote()], "set up", [placed])
        assert caught.value.message == (f"The rollout worker 0 could not set up on Ray node {placed.ip} (node "
                                        f"{placed.node_id[:12]}): FileNotFoundError: /models/qwen-image/model_index.json")
        with pytest.raises(UsageError) as caught:
            placement.gather([stub.bad_setting.remote()], "set up", [placed])
        assert caught.value.message.startswith("'/models/qwen-image' is not a diffusers")
        assert caught.value.details[-1] == f"(the rollout worker 0, on Ray node {placed.where()})"
        call = stub.exit_process.remote()  # its process ends (in the call: no race with a kill); its node lives on
        with pytest.raises(ray.exceptions.RayActorError) as died:
            ray.get(call, timeout=60)
        lost = placement.explain(died.value, "rollout")
        assert isinstance(lost, WorkerLostError) and lost.node is None and lost.lost == [placed]
        assert lost.message == (f"The rollout group's rollout worker 0 on {placed.where()} died during the rollout (its "
                                "node is alive: the worker's process ended).")
    finally:
        ray.shutdown()


def test_a_workers_files_cross_nodes_through_ray_with_their_checksums(cluster, tmp_path):
    """The transfer a checkpoint takes without run.storage, between a worker node and the driver: files (one of
    several chunks) streamed from an actor on node b into the driver's directory, checked; shipped back through the
    object store into the actor's scratch directory, checked there."""
    from omnirl_core.loop.transfer import CHUNK, Receiver, chunks_of, ship

    @ray.remote(num_cpus=0, max_restarts=0, resources={"reward": 0.001})
    class Holder:
        def where(self):
            return ray.get_runtime_context().get_node_id()

        def save(self):
            import hashlib

            from omnirl_core.loop.transfer import scratch

            with scratch() as directory:
                (directory / "shards").mkdir()
                (directory / "shards" / "rank-00001-of-00002.safetensors").write_bytes(b"\x01" * (CHUNK + 5))
                (directory / "optimizer.json").write_text("{}")
                yield {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.rglob("*") if p.is_file()}
                yield from chunks_of(directory)

        def load(self, files):
            import hashlib

            from omnirl_core.loop.transfer import scratch, unpack

            with scratch() as directory:
                moved = unpack(files, directory)
                return moved, {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                               for p in directory.rglob("*") if p.is_file()}

    ray.init(address=cluster.cluster.address, log_to_driver=False)
    try:
        holder = Holder.remote()
        assert ray.get(holder.where.remote()) == cluster.node_id("b")
        stream = holder.save.options(num_returns="streaming").remote()
        sums = ray.get(next(stream))
        receiver = Receiver(tmp_path)
        chunks = 0
        for ref in stream:
            receiver.take(ray.get(ref))
            chunks += 1
        receiver.close()
        assert chunks == 3 and receiver.bytes == CHUNK + 5 + 2  # the shard in two chunks, the JSON in one
        assert {Path(k).name: v for k, v in receiver.sums.items()} == sums
        names = ["optimizer.json", "shards/rank-00001-of-00002.safetensors"]
        moved, there = ray.get(holder.load.remote(ship(tmp_path, names)))
        assert moved == CHUNK + 7 and there == sums
    finally:
        ray.shutdown()


def test_rewards_served_on_the_reward_node_train_as_the_single_node_run(cluster, single_node):
    """run.reward_serving=serve over the three nodes: the Ray Serve replica runs on the node with the reward resource
    (b), and the run's metrics and weights are the single-node reward actors' run's, bit for bit."""
    proc = cluster.train("--output-dir", "runs/served", *POOLS, "--set", "run.reward_serving=serve")
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = cluster.runs / "served"
    served = json.loads((run / "runtime.json").read_text())["ray"]["reward_serve"]
    assert [r["node_id"] for r in served["replicas_at_start"]] == [cluster.node_id("b")]
    assert [_steady(r) for r in _rows(run)] == [_steady(r) for r in _rows(single_node)]
    assert _weights(run / "checkpoints" / "step-000002") == _weights(single_node / "checkpoints" / "step-000002")
