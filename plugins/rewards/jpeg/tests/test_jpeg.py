import pytest
import torch
from omnirl_plugin_jpeg.reward import JpegCompressibility, JpegOptions


def test_flat_images_compress_better_than_noise():
    flat = torch.full((3, 64, 64), 0.5)
    noise = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0))
    flat_score, noise_score = JpegCompressibility()([flat, noise], ["a", "b"])
    assert flat_score < 0 and noise_score < flat_score - 2.0  # kB: noise is several times larger


def test_quality_changes_the_size():
    noise = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0))
    low = JpegCompressibility(JpegOptions(quality=10))([noise], ["a"])[0]
    high = JpegCompressibility(JpegOptions(quality=95))([noise], ["a"])[0]
    assert low > high


def test_reward_contract():
    from omnirl_core.testing import check_reward

    check_reward(JpegCompressibility(), [torch.rand(3, 32, 32), torch.zeros(3, 32, 32)], ["a", "b"])


def test_scale_multiplies_the_reward_as_flow_grpos_division_by_500():
    image = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0))
    [plain] = JpegCompressibility()([image], ["a cat"])
    [scaled] = JpegCompressibility(JpegOptions(scale=1 / 500))([image], ["a cat"])
    assert plain < 0 and scaled == pytest.approx(plain / 500, rel=1e-12)
