"""``omnirl plan`` for several nodes (issue 32): the plan's workers placed on N nodes of M devices by their groups'
``run.ray_pools`` strategies, with per-node device and host memory; the arithmetic on a toy sizing, then the real
CLI on the released Qwen-Image."""

from __future__ import annotations

import json

import pytest

from omnirl_core.errors import ConfigError, UsageError
from omnirl_core.planning.model import ModelSizing
from omnirl_core.planning.nodes import layout_nodes
from omnirl_core.planning.planner import GIB, plan_memory
from tests.conftest import run_cli

from .test_plan import SIZING, _resolved

FULL = {"model": {"dtype": "bfloat16", "lora": {"enabled": False}, "offload": "cpu"},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "height": 64, "width": 64, "num_steps": 3}}


def _plan(ranks: int, pools: dict | None = None, device_type: str = "cuda"):
    config = {**FULL, "run": {"executor": "ray", "placement": "split", "train_workers": ranks,
                              "ray_pools": pools or {}}}
    resolved = _resolved(config, engine="fsdp2")
    plan = plan_memory(resolved, 80 * GIB, ModelSizing(trainable=10 * 2**30, lora=False, **SIZING),
                       device_type=device_type)
    return resolved.config, plan


def test_packed_ranks_fill_a_node_and_each_node_adds_up_its_devices_and_host_memory():
    config, plan = _plan(8)
    actor, rollout = plan.groups
    # host memory beside each device: the offloaded encoders (actor and rollout hold the whole model), a step's
    # samples on the rollout worker, the trained weights' CPU copy of each weight sync (full fine-tuning: 20 GiB)
    offloaded = (4 * 2**30 + 2**28) * 2
    assert actor.host == {"weights/text_encoder (offloaded)": 8 * GIB, "weights/vae (offloaded)": 2**29,
                          "trained weights, CPU copy (weight sync)": 20 * GIB}
    assert rollout.host_total == offloaded + 20 * GIB + rollout.host["samples of a step (outputs, trajectories)"]
    layout = layout_nodes(plan, config, 2, 8)
    first, second = layout.nodes
    assert first.groups() == {"actor": 8} and second.groups() == {"rollout": 1}
    assert first.device_total == 8 * actor.total and first.largest_device == actor.total
    assert first.host_total == 8 * actor.host_total and second.host_total == rollout.host_total
    data = layout.as_dict()
    assert data["largest_node"] == {"device_total": 8 * actor.total, "host_total": 8 * actor.host_total}
    assert data["strategies"] == {"actor": "pack", "rollout": "pack"}
    text = layout.table()
    assert "actor x8" in text and f"{8 * actor.total / GIB:.2f}" in text
    assert f"2 of 2 node(s) used (actor pack, rollout pack); largest node {8 * actor.total / GIB:.1f} GiB" in text


def test_strategies_place_as_ray_places_them_and_a_layout_the_nodes_cannot_hold_is_refused():
    config, plan = _plan(4, {"train": {"strategy": "strict_spread", "resources": {"train": 0.001}},
                             "rollout": {"strategy": "pack"}})
    layout = layout_nodes(plan, config, 4, 2)
    assert [n.groups() for n in layout.nodes] == [{"actor": 1, "rollout": 1}, {"actor": 1}, {"actor": 1},
                                                  {"actor": 1}]
    assert any("node selectors (resources, node) are not modelled" in note for note in layout.notes)
    config, plan = _plan(12)  # no node holds the group: pack fills the emptiest node, then the next
    assert [n.groups() for n in layout_nodes(plan, config, 2, 8).nodes] == [{"actor": 8}, {"actor": 4, "rollout": 1}]
    config, plan = _plan(4, {"train": {"strategy": "spread"}})
    assert [n.groups() for n in layout_nodes(plan, config, 3, 4).nodes] == [
        {"actor": 2, "rollout": 1}, {"actor": 1}, {"actor": 1}]
    config, plan = _plan(4, {"train": {"strategy": "strict_spread"}})
    with pytest.raises(UsageError, match=r"run.ray_pools.train.strategy=strict_spread puts each of the 4 actor "
                                         r"workers on a node of its own, but only 3 node\(s\)"):
        layout_nodes(plan, config, 3, 8)
    config, plan = _plan(4, {"train": {"strategy": "strict_pack"}})
    with pytest.raises(UsageError, match="strict_pack puts all 4 actor workers on one node"):
        layout_nodes(plan, config, 4, 2)
    with pytest.raises(UsageError, match=r"2 node\(s\) of 2 device\(s\) hold 4 workers; this run's groups need 5"):
        layout_nodes(plan, config, 2, 2)


def test_on_the_cpu_each_node_holds_its_workers_in_one_memory():
    config, plan = _plan(2, device_type="cpu")
    assert plan.shared and not any(g.host for g in plan.groups)  # the rows are the host's memory already
    layout = layout_nodes(plan, config, 2, 2)
    assert [n.groups() for n in layout.nodes] == [{"actor": 2}, {"rollout": 1}]
    layout.device_memory = 2 * plan.groups[0].total  # less the headroom: the two ranks' node is over it
    with pytest.raises(ConfigError, match=r"do not fit in the memory of 1 of its 2 nodes") as caught:
        layout.check()
    assert "node 0 (actor x2)" in caught.value.render()


PLAN_8GPU = ("plan", "--model", "qwen-image", "--algo", "flowgrpo", "--reward", "jpeg", "--device", "cuda",
             "--device-memory", "80GiB", "--executor", "ray", "--set", "run.placement=split",
             "--set", "train.engine=fsdp2", "--set", "run.train_workers=8", "--set", "model.lora.enabled=false",
             "--set", "model.offload=cpu", "--set", "model.options.gradient_checkpointing=true",
             "--set", "train.micro_batch_size=1", "--set", "rollout.options.max_num_seqs=1")


def test_omnirl_plan_over_nodes_prints_each_nodes_totals_and_their_json():
    proc = run_cli(*PLAN_8GPU, "--nodes", "2", "--devices-per-node", "8", "--format", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)
    actor, rollout = plan["groups"]
    nodes = plan["nodes"]
    assert (nodes["count"], nodes["devices_per_node"]) == (2, 8)
    assert [n["groups"] for n in nodes["nodes"]] == [{"actor": 8}, {"rollout": 1}]
    assert nodes["nodes"][0]["device_total"] == 8 * actor["total"]
    assert nodes["nodes"][0]["host_total"] == 8 * actor["host_total"] > 0
    assert nodes["nodes"][1]["host_total"] == rollout["host_total"]
    assert actor["host"]["trained weights, CPU copy (weight sync)"] > 30 * GIB  # the 20B transformer, bf16

    table = run_cli(*PLAN_8GPU, "--nodes", "3", "--devices-per-node", "4",
                    "--set", "run.ray_pools.train.strategy=spread")
    assert table.returncode == 0, table.stderr[-2000:]
    assert "per device (GiB)" in table.stdout and "devices (of 4)" in table.stdout
    assert "3 of 3 node(s) used (actor spread, rollout pack)" in table.stdout

    alone = run_cli(*PLAN_8GPU, "--nodes", "2")
    assert alone.returncode == 2 and "--nodes and --devices-per-node go together" in alone.stderr
    small = run_cli(*PLAN_8GPU, "--nodes", "2", "--devices-per-node", "4")
    assert small.returncode == 2 and "this run's groups need 9: actor x8, rollout x1" in small.stderr
