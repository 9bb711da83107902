"""Multi-reward advantages: per-reward normalisation (rewards[].advantage = own) against the formula written
out here, the default (joint) unchanged, a reward dropped for a group, and the config field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omnirl_core.config import RewardEntry
from omnirl_core.rl.advantage import assign_group_advantages


def _samples(rows: list[dict[str, float]], groups: list[int], weights: dict[str, float]):
    out = []
    for r, g in zip(rows, groups):
        out.append(SimpleNamespace(rewards=dict(r), reward=sum(weights[k] * v for k, v in r.items()),
                                   request=SimpleNamespace(group=g), advantage=None))
    return out


def _ga(values: list[float], groups: list[int]) -> list[float]:
    """(r - group mean) / (group population std + 1e-4)."""
    out = []
    for v, g in zip(values, groups):
        members = [x for x, h in zip(values, groups) if h == g]
        mean = sum(members) / len(members)
        std = (sum((x - mean) ** 2 for x in members) / len(members)) ** 0.5
        out.append((v - mean) / (std + 1e-4))
    return out


ROWS = [{"a": 1.0, "b": 100.0, "c": 0.2}, {"a": 2.0, "b": 300.0, "c": 0.1}, {"a": 4.0, "b": 200.0, "c": 0.9},
        {"a": 0.0, "b": 10.0, "c": 0.5}, {"a": 1.0, "b": 20.0, "c": 0.4}, {"a": 3.0, "b": 15.0, "c": 0.3}]
GROUPS = [0, 0, 0, 1, 1, 1]
W = {"a": 1.0, "b": 0.01, "c": 2.0}


def test_own_advantages_are_summed_per_reward():
    entries = [RewardEntry(name="a", weight=1.0), RewardEntry(name="b", weight=0.01, advantage="own"),
               RewardEntry(name="c", weight=2.0, advantage="own")]
    samples = _samples(ROWS, GROUPS, W)
    adv = assign_group_advantages(samples, global_std=False, clip=None, rewards=entries)
    ga_a = _ga([r["a"] for r in ROWS], GROUPS)
    ga_b = _ga([r["b"] for r in ROWS], GROUPS)
    ga_c = _ga([r["c"] for r in ROWS], GROUPS)
    expected = [a + 0.01 * b + 2.0 * c for a, b, c in zip(ga_a, ga_b, ga_c)]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)
    assert [s.advantage for s in samples] == pytest.approx(expected, abs=1e-5)
    clipped = assign_group_advantages(_samples(ROWS, GROUPS, W), global_std=False, clip=1.0, rewards=entries)
    assert clipped.tolist() == pytest.approx([max(-1.0, min(1.0, e)) for e in expected], abs=1e-5)


def test_joint_is_the_advantage_of_the_weighted_sum():
    entries = [RewardEntry(name=k, weight=w) for k, w in W.items()]
    got = assign_group_advantages(_samples(ROWS, GROUPS, W), global_std=False, clip=None, rewards=entries)
    summed = [sum(W[k] * v for k, v in r.items()) for r in ROWS]
    assert got.tolist() == pytest.approx(_ga(summed, GROUPS), abs=1e-5)
    without = assign_group_advantages(_samples(ROWS, GROUPS, W), global_std=False, clip=None)
    assert torch.equal(got, without)


def test_a_reward_dropped_for_a_group_adds_nothing_there():
    rows = [dict(r) for r in ROWS]
    for r in rows[3:]:
        del r["c"]  # optional reward c failed for group 1
    entries = [RewardEntry(name="a"), RewardEntry(name="c", weight=2.0, advantage="own")]
    got = assign_group_advantages(_samples(rows, GROUPS, W), global_std=False, clip=None, rewards=entries)
    ga_a = _ga([r["a"] for r in rows], GROUPS)
    ga_c = _ga([r["c"] for r in rows[:3]], GROUPS[:3])
    assert got.tolist() == pytest.approx([ga_a[i] + 2.0 * ga_c[i] for i in range(3)] + ga_a[3:], abs=1e-5)


def test_the_field_is_validated():
    with pytest.raises(ValueError, match="advantage"):
        RewardEntry(name="a", advantage="separate")
