"""Rollout correction: sequence IS weights from per-step deltas, the RS band, the diagnostics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from omnirl_core.rl.correction import (
    record_deltas,
    rs_mask,
    sequence_diagnostics,
    sequence_log_weights,
    step_diagnostics,
)


@dataclass
class FakeSample:
    extras: dict = field(default_factory=dict)


@dataclass
class Unit:  # the two attributes of a Transition that correction reads
    sample: FakeSample
    step: int
    rollout_logprob: torch.Tensor


def _units(deltas: list[list[float]]):
    units, train = [], []
    for per_step in deltas:
        sample = FakeSample()
        for j, d in enumerate(per_step):
            units.append(Unit(sample, j, torch.tensor(-1.0)))
            train.append(-1.0 + d)
    return units, torch.tensor(train)


def test_sequence_weights_mask_and_rejected_fraction():
    units, logp_train = _units([[0.0, 0.0], [1.0, 1.0], [-0.1, 0.3]])
    delta = record_deltas(units, logp_train)
    torch.testing.assert_close(delta, logp_train + 1.0)
    log_w = sequence_log_weights(units, "mean")
    torch.testing.assert_close(log_w, torch.tensor([0.0, 0.0, 1.0, 1.0, 0.1, 0.1]))
    torch.testing.assert_close(sequence_log_weights(units, "sum")[4], torch.tensor(0.2))
    keep = rs_mask(log_w, (0.5, 2.0))  # exp(1) = 2.72 is outside: the whole second sample goes
    assert keep.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert rs_mask(log_w, None).tolist() == [1.0] * 6
    diag = sequence_diagnostics(units, log_w, keep)
    assert math.isclose(diag["rs/rejected_frac"], 1 / 3, rel_tol=1e-6)
    w = torch.tensor([1.0, math.e, math.exp(0.1)], dtype=torch.float64)
    assert math.isclose(diag["is/ess"], float(w.sum() ** 2 / (3 * (w**2).sum())), rel_tol=1e-6)
    assert math.isclose(diag["is/seq_weight_max"], math.e, rel_tol=1e-6)


def test_bypass_keeps_the_first_delta_and_step_diagnostics():
    units, logp = _units([[0.2, -0.2]])
    record_deltas(units, logp)
    record_deltas(units, logp + 5.0, overwrite=False)  # a later evaluation, after an update
    recorded = units[0].sample.extras["is_delta"]
    assert sorted(recorded) == [0, 1]
    assert math.isclose(recorded[0], 0.2, abs_tol=1e-6) and math.isclose(recorded[1], -0.2, abs_tol=1e-6)
    diag = step_diagnostics(torch.tensor([0.2, -0.2]))
    assert math.isclose(diag["logprob/abs_delta_mean"], 0.2, rel_tol=1e-6)
    assert math.isclose(diag["is/kl_k1"], 0.0, abs_tol=1e-9)
    assert diag["is/kl_k3"] > 0  # k3 = E[r - 1 - log r] >= 0, = 0 only at r = 1
    zero = step_diagnostics(torch.zeros(3))
    assert zero["is/kl_k3"] == 0.0 and zero["logprob/abs_delta_max"] == 0.0


def test_minibatches_keep_samples_whole_and_ranks_take_whole_samples():
    from omnirl_core.loop.training import minibatches, rank_share

    units, _ = _units([[0.0] * 3, [0.0] * 2, [0.0] * 3, [0.0]])
    batches = minibatches(units, 2, step=4, shuffle=True)
    assert sorted(id(u) for b in batches for u in b) == sorted(id(u) for u in units)
    owner = {id(u.sample): i for i, b in enumerate(batches) for u in b}
    assert all(owner[id(u.sample)] == i for i, b in enumerate(batches) for u in b)  # no sample split
    shares = [rank_share(units, r, 2) for r in range(2)]
    assert [len(s) for s in shares] == [6, 3]  # samples 0 and 2 (3 steps each) vs 1 and 3
    assert {id(u.sample) for u in shares[0]}.isdisjoint({id(u.sample) for u in shares[1]})


def test_fallback_monitor_needs_a_streak_in_bypass_mode():
    from omnirl_core.rl.correction import FallbackMonitor

    monitor = FallbackMonitor(0.05, 3)
    seen = [monitor.observe("bypass", {"rs/rejected_frac": f}) for f in (0.2, 0.2, 0.0, 0.1, 0.3, 0.06)]
    assert seen == [False, False, False, False, False, True]
    assert not monitor.observe("recompute", {"rs/rejected_frac": 1.0})
    assert not FallbackMonitor(None, 1).observe("bypass", {"rs/rejected_frac": 1.0})
