"""``check_algorithm_step``, the contract test an algorithm plugin runs on the core's toy flow model: an algorithm
that declares its controller side reads no trajectory gets its samples there without one (as a colocated Ray
worker hands them out) and trains on the units the trajectories were put back into; a wrong declaration is
named."""

from __future__ import annotations

import math

import pytest

from omnirl_core.testing.algorithm import check_algorithm_step


def test_flowgrpo_trains_on_samples_its_controller_got_without_trajectories():
    from omnirl_plugin_flowgrpo.algorithm import FlowGRPO, FlowGRPOConfig

    assert not FlowGRPO.controller_reads_trajectory
    metrics = check_algorithm_step(lambda config: FlowGRPO(FlowGRPOConfig(), config))
    assert math.isfinite(metrics["loss"])


def test_an_algorithm_whose_controller_reads_trajectories_gets_them():
    from omnirl_plugin_nft.algorithm import DiffusionNFT, NFTConfig  # its units noise the final latents

    assert DiffusionNFT.controller_reads_trajectory
    metrics = check_algorithm_step(lambda config: DiffusionNFT(NFTConfig(), config))
    assert math.isfinite(metrics["loss"])


def test_a_wrong_declaration_is_named():
    from omnirl_plugin_flowgrpo.algorithm import FlowGRPO, FlowGRPOConfig

    class Peeking(FlowGRPO):
        def training_units(self, samples):
            assert all(s.latents.shape[0] > 1 for s in samples)  # reads the trajectory it declared it does not
            return super().training_units(samples)

    with pytest.raises(AssertionError, match="Peeking.controller_reads_trajectory is False.*latents"):
        check_algorithm_step(lambda config: Peeking(FlowGRPOConfig(), config))
