"""The parts of running on a Ray cluster that need no cluster (issue 32): placement checks against a table of nodes,
the config of a group's pool, checkpoint files in chunks and each rank's part of them, the version comparison, the
addresses a run joins, the lost-worker error. ``test_cluster.py`` runs them on a real local cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnirl_core.config import build_config
from omnirl_core.errors import ConfigError, PluginError, UsageError
from omnirl_core.loop.cluster import (
    Node,
    Placed,
    WorkerLostError,
    check_pools,
    check_versions,
    cluster_address,
    group_pool,
)
from omnirl_core.loop.transfer import Chunk, Receiver, TransferError, chunks_of, rank_part

HEAD = Node("h" * 56, "10.0.0.1", "head", True, {"CPU": 1, "rollout": 1, "node:10.0.0.1": 1,
                                                   "node:__internal_head__": 1})
A = Node("a" * 56, "10.0.0.2", "a", True, {"CPU": 1, "train": 1, "node:10.0.0.2": 1})
B = Node("b" * 56, "10.0.0.3", "b", True, {"CPU": 1, "train": 1, "reward": 1, "node:10.0.0.3": 1})
DEAD = Node("d" * 56, "10.0.0.4", "d", False, {"CPU": 8, "train": 1, "node:10.0.0.4": 1})
NODES = [HEAD, A, B, DEAD]


def _pool_config(**pool):
    return build_config({"model": {"name": "m"}, "algorithm": {"name": "a"},
                         "run": {"ray_pools": {"train": pool}}}).run.ray_pools["train"]


def test_a_groups_pool_adds_its_selector_to_every_bundle():
    config = _pool_config(strategy="strict_spread", resources={"train": 0.001}, node="10.0.0.2")
    pool = group_pool("train", {"CPU": 0.5}, 2, config)
    assert pool.bundles == [{"CPU": 0.5, "train": 0.001, "node:10.0.0.2": 0.001}] * 2
    assert pool.ray_strategy == "STRICT_SPREAD"
    assert group_pool("train", {"CPU": 0.5}, 2, _pool_config(node="head")).bundles[0]["node:__internal_head__"] > 0
    assert group_pool("reward", {"CPU": 0.5}, 1, None).bundles == [{"CPU": 0.5}]  # no entry: packed anywhere


def test_pools_the_nodes_can_hold_pass():
    check_pools([group_pool("train", {"CPU": 0.5}, 2, _pool_config(strategy="strict_spread",
                                                                    resources={"train": 0.001})),
                 group_pool("rollout", {"CPU": 0.5}, 1, _pool_config(node="head")),
                 group_pool("reward", {"CPU": 0.5}, 0, None)], NODES)


def test_pools_the_nodes_cannot_hold_are_refused_together_with_the_nodes_listed():
    pools = [
        group_pool("train", {"CPU": 0.5}, 3, _pool_config(strategy="strict_spread", resources={"train": 0.001})),
        group_pool("rollout", {"CPU": 0.5}, 1, _pool_config(node="10.9.9.9")),
        group_pool("reward", {"CPU": 0.5}, 1, _pool_config(resources={"judge": 1})),
        group_pool("reference", {"CPU": 0.5}, 3, _pool_config(strategy="strict_pack")),
    ]
    with pytest.raises(UsageError) as caught:
        check_pools(pools, NODES)
    err = caught.value
    assert err.exit_code == 2 and "4 problem(s)" in err.message
    text = err.render()
    # the dead node's train resource does not count
    assert "strict_spread puts each of the 3 train workers on a node of its own, but only 2 node(s) have" in text
    assert "run.ray_pools.rollout.node: no live node has the address '10.9.9.9' (nodes: 10.0.0.1, 10.0.0.2, " \
           "10.0.0.3)" in text
    assert "run.ray_pools.reward: no node has what one reward worker reserves {'CPU': 0.5, 'judge': 1.0}" in text
    assert "strict_pack puts all 3 reference workers on one node, but no node has {'CPU': 1.5}" in text
    assert "10.0.0.3 (node bbbbbbbbbbbb): CPU=1, reward=1, train=1" in text
    assert "10.0.0.4" not in text.split("Live nodes:")[1]


def test_a_pool_config_names_only_custom_resources_and_known_groups_and_strategies():
    with pytest.raises(ConfigError) as caught:
        build_config({"model": {"name": "m"}, "algorithm": {"name": "a"},
                      "run": {"ray_pools": {"train": {"resources": {"CPU": 2, "node:10.0.0.1": 1}},
                                            "rollouts": {}, "reward": {"strategy": "scatter", "resources": {"x": 0}}}}})
    text = caught.value.render()
    assert caught.value.exit_code == 2 and "4 problem(s)" in text
    assert "run.ray_pools.train.resources: Value error, CPU, node:10.0.0.1 cannot be selected here" in text
    assert "run.ray_pools.rollouts" in text and "run.ray_pools.reward.strategy" in text
    assert "run.ray_pools.reward.resources.x" in text


def test_checkpoint_files_travel_in_chunks_and_arrive_checked(tmp_path: Path, monkeypatch):
    from omnirl_core.loop import transfer

    monkeypatch.setattr(transfer, "CHUNK", 5)
    source = tmp_path / "worker"
    (source / "shards").mkdir(parents=True)
    (source / "shards" / "rank-00001-of-00002.safetensors").write_bytes(b"0123456789ab")  # 3 chunks
    (source / "empty.json").write_bytes(b"")
    (source / "exact").write_bytes(b"01234")  # exactly one chunk
    chunks = list(chunks_of(source))
    assert [(c.name, len(c.data), c.last) for c in chunks] == [
        ("empty.json", 0, True), ("exact", 5, True), ("shards/rank-00001-of-00002.safetensors", 5, False),
        ("shards/rank-00001-of-00002.safetensors", 5, False), ("shards/rank-00001-of-00002.safetensors", 2, True)]
    target = tmp_path / "driver"
    target.mkdir()
    receiver = Receiver(target)
    for chunk in chunks + [c for c in chunks if c.name == "exact"]:  # a second rank sends one file again
        receiver.take(chunk)
    assert receiver.bytes == 12 + 5 + 5
    assert {p.name: p.read_bytes() for p in target.rglob("*") if p.is_file()} == {
        "empty.json": b"", "exact": b"01234", "rank-00001-of-00002.safetensors": b"0123456789ab"}
    with pytest.raises(TransferError, match="arrived with SHA-256"):
        Receiver(target).take(Chunk("bad", b"x", True, sha256="0" * 64, size=1))
    twice = Receiver(target)
    twice.take(chunks[1])
    with pytest.raises(TransferError, match="two workers wrote checkpoint file exact with different contents"):
        other = chunks_of_bytes(tmp_path, "exact", b"43210")
        twice.take(other)
    for name in ("../outside", "/etc/passwd"):
        with pytest.raises(TransferError, match="not a path inside the checkpoint"):
            Receiver(target).take(Chunk(name, b"", True))


def chunks_of_bytes(tmp_path: Path, name: str, data: bytes) -> Chunk:
    folder = tmp_path / "other"
    folder.mkdir(exist_ok=True)
    (folder / name).write_bytes(data)
    return next(c for c in chunks_of(folder) if c.name == name)


def test_each_rank_gets_its_own_shards_back_unless_the_world_size_changed():
    names = ["algorithm.json", "pytorch_lora_weights.safetensors", "shards/index.json",
             "shards/rank-00000-of-00002.safetensors", "shards/rank-00001-of-00002.safetensors"]
    common = names[:3]
    assert rank_part(names, 0, 2) == [*common, names[3]]
    assert rank_part(names, 1, 2) == [*common, names[4]]
    assert rank_part(names, 0, 3) == names  # resharding reads every rank's shard


def _placed(group: str, index: int, node: Node) -> Placed:
    return Placed(group, index, f"actor-{group}-{index}", node.node_id, node.ip, node.hostname, 100 + index)


def test_a_node_with_other_versions_is_named_with_what_differs():
    driver = {"omnirl": "0.1.0", "omnirl-plugin-color": "0.1.0"}
    same = {"omnirl": "0.1.0", "omnirl-plugin-color": "0.1.0"}
    check_versions(driver, [(_placed("train", 0, A), same)])
    with pytest.raises(PluginError) as caught:
        check_versions(driver, [(_placed("train", 0, A), same),
                                (_placed("reward", 0, B), {"omnirl": "0.1.0", "omnirl-plugin-color": "9.9.9"}),
                                (_placed("train", 1, B), {"omnirl": "0.1.0"})])
    text = caught.value.render()
    assert caught.value.exit_code == 3
    assert text.startswith("Ray node 10.0.0.3 (node bbbbbbbbbbbb) runs other omnirl or plugin versions than this "
                           "driver.")
    assert "node 10.0.0.3 (node bbbbbbbbbbbb) (its reward worker 0 runs there):" in text
    assert "  omnirl-plugin-color: 0.1.0 on the driver, 9.9.9 there" in text


def test_the_cluster_a_run_joins(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_address(None) == (None, "local")
    assert cluster_address("auto") == ("auto", "run.ray_address")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert cluster_address(None) == ("10.0.0.1:6379", "RAY_ADDRESS")
    assert cluster_address("10.0.0.9:6379") == ("10.0.0.9:6379", "run.ray_address")  # the flag wins
    with pytest.raises(UsageError, match=r"run.ray_address=ray://h:10001 is a Ray Client address") as caught:
        cluster_address("ray://h:10001")
    assert caught.value.exit_code == 2 and "ray job submit" in caught.value.render()


def test_a_lost_node_is_named_with_its_groups_and_the_checkpoint_to_resume_from(tmp_path: Path):
    err = WorkerLostError("update", A, [_placed("train", 0, A)], "The actor died because its node has died.")
    err.locate(3, tmp_path / "checkpoints" / "step-000002")
    text = err.render()
    assert err.exit_code == 1
    assert text.splitlines()[0] == ("Ray node 10.0.0.2 (node aaaaaaaaaaaa) was lost during step 3 (update): the "
                                    "train group's train rank 0 ran there.")
    assert f"Last complete checkpoint: {tmp_path / 'checkpoints' / 'step-000002'}; nothing after it was saved." in text
    assert text.splitlines()[-1].endswith("rerun the same command: it resumes from step-000002 exactly.")
    alone = WorkerLostError("rollout", None, [_placed("rollout", 0, HEAD)], "worker exited")
    alone.locate(None, None)
    assert "died during the rollout (its node is alive" in alone.message
    assert "Last complete checkpoint: none" in alone.render()


def test_a_refused_join_says_whether_anything_answers_and_what_token_the_driver_has(monkeypatch, tmp_path: Path):
    """Ray reports a cluster that refuses a driver's token as it reports no cluster at all (a ConnectionError after
    its timeout); the join tells them apart by whether anything listens at the address."""
    import socket

    from omnirl_core.loop.cluster import join

    ray = pytest.importorskip("ray")

    def refused(*args, **kwargs):
        raise ConnectionError("Failed to connect to Ray cluster at 127.0.0.1:1")

    monkeypatch.setattr(ray, "init", refused)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        with pytest.raises(UsageError) as caught:
            join(f"127.0.0.1:{port}", "RAY_ADDRESS", None)
    text = caught.value.render()
    assert text.startswith(f"The Ray cluster at 127.0.0.1:{port} (RAY_ADDRESS) answers but refused this driver: it "
                           "likely needs token authentication, and this driver has no token.")
    assert "RAY_AUTH_MODE: unset" in text and f"{tmp_path}/.ray/auth_token: missing" in text
    with pytest.raises(UsageError, match=rf"No Ray cluster answers at 127.0.0.1:{port} \(run.ray_address\)"):
        join(f"127.0.0.1:{port}", "run.ray_address", None)  # the listener is closed now
    monkeypatch.setenv("RAY_AUTH_TOKEN", "not-the-clusters")
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        with pytest.raises(UsageError, match="the token this driver has is likely not the cluster's"):
            join(f"127.0.0.1:{listening.getsockname()[1]}", "run.ray_address", None)
