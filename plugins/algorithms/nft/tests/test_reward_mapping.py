"""DiffusionNFT's reward -> optimality mapping (issue 30, learning math): by default NVlabs' trainer's
r = clip(A, -5, 5) / 5 / 2 + 0.5, i.e. Z = 5 std; ``adv_clip: 1`` the paper's r = 0.5 + 0.5 clip(A, -1, 1)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omnirl_plugin_nft.algorithm import DiffusionNFT, NFTConfig

from omnirl_core.config import RunConfig

# two groups of four; A = (r - group mean) / batch std runs from -1.24 to 1.54
REWARDS = [0.20, 0.90, 0.50, 0.45, 0.10, 0.15, 0.60, 0.30]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]


def _advantages_numpy() -> np.ndarray:
    r, g = np.array(REWARDS), np.array(GROUPS)
    centred = r - np.array([r[g == k].mean() for k in g])
    return centred / r.std()  # population std over the batch (global_std, the default)


def _optimality(options: NFTConfig | None) -> np.ndarray:
    algo = DiffusionNFT(options, RunConfig.model_validate({"rollout": {"num_steps": 6}}))
    samples = [SimpleNamespace(reward=r, request=SimpleNamespace(group=g), advantage=None)
               for r, g in zip(REWARDS, GROUPS)]
    metrics = algo.assign_advantages(samples)
    out = np.array([s.advantage for s in samples])
    assert metrics["nft/optimality_mean"] == pytest.approx(out.mean(), abs=1e-6)
    return out


def test_default_is_the_published_trainers_mapping():
    a = _advantages_numpy()
    expected = np.clip(a, -5, 5) / 5 / 2 + 0.5
    got = _optimality(None)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    # on these rewards: [0.376 .. 0.654] (the paper's mapping: [0 .. 1])
    assert got.min() == pytest.approx(0.376, abs=1e-3) and got.max() == pytest.approx(0.654, abs=1e-3)
    assert NFTConfig().adv_clip == 5.0


def test_adv_clip_one_is_the_papers_mapping():
    a = _advantages_numpy()
    got = _optimality(NFTConfig(adv_clip=1.0))
    np.testing.assert_allclose(got, 0.5 + 0.5 * np.clip(a, -1, 1), rtol=0, atol=1e-6)
    assert got.min() == 0.0 and got.max() == 1.0  # the best and worst samples saturate


def test_the_mapping_is_linear_below_the_clip_and_centred():
    """Below the clip both mappings are 0.5 + A / (2 adv_clip): r - 0.5 scales as 1 / adv_clip."""
    a = _advantages_numpy()
    inside = np.abs(a) < 1
    wide, narrow = _optimality(NFTConfig(adv_clip=5.0)), _optimality(NFTConfig(adv_clip=1.0))
    np.testing.assert_allclose((wide - 0.5)[inside] * 5, (narrow - 0.5)[inside], atol=1e-6)
    groups = torch.tensor(GROUPS)
    for k in (0, 1):
        assert float(torch.tensor(wide)[groups == k].mean()) == pytest.approx(0.5, abs=1e-6)


def test_adv_clip_must_be_positive():
    with pytest.raises(ValueError, match="adv_clip"):
        NFTConfig(adv_clip=0.0)
