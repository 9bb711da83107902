import torch

from omnirl_core.rl.advantage import group_advantages


def test_group_advantages_per_group_and_global():
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 13.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    per_group = group_advantages(rewards, groups, global_std=False, clip=None)
    expected0 = (torch.tensor([1.0, 2.0, 3.0]) - 2.0) / (torch.tensor([1.0, 2.0, 3.0]).std(unbiased=False) + 1e-4)
    torch.testing.assert_close(per_group[:3], expected0)
    glob = group_advantages(rewards, groups, global_std=True, clip=None)
    torch.testing.assert_close(glob[3:], (torch.tensor([10.0, 10.0, 13.0]) - 11.0) / (rewards.std(unbiased=False) + 1e-4))
    assert abs(float(per_group[:3].sum())) < 1e-5


def test_advantages_are_clipped():
    rewards = torch.tensor([0.0] * 99 + [1.0])
    adv = group_advantages(rewards, torch.zeros(100, dtype=torch.long), clip=5.0)
    assert float(adv.max()) == 5.0
