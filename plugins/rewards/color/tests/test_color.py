import math

import pytest
import torch
from omnirl_plugin_color.reward import ColorMatch, named_color


def _solid(rgb):
    return torch.tensor(rgb, dtype=torch.float32).view(3, 1, 1).expand(3, 16, 16)


def test_matching_colour_scores_one_and_opposite_scores_zero():
    reward = ColorMatch()
    scores = reward([_solid((1, 0, 0)), _solid((0, 1, 1)), _solid((0.5, 0.5, 0.5))],
                    ["a red square", "a red square", "a red square"])
    assert scores[0] == pytest.approx(1.0)
    assert scores[1] == pytest.approx(0.0, abs=1e-6)
    assert scores[2] == pytest.approx(1 - math.sqrt(0.75) / math.sqrt(3))


def test_prompt_decides_the_target():
    blue = _solid((0, 0, 1))
    a, b = ColorMatch()([blue, blue], ["a blue car", "a YELLOW car"])
    assert a == pytest.approx(1.0) and b < 0.1


def test_prompt_without_a_colour_is_an_error():
    with pytest.raises(ValueError, match="names no colour"):
        named_color("a photo of a cat")


def test_reward_contract():
    from omnirl_core.testing import check_reward

    check_reward(ColorMatch(), [_solid((1, 0, 0)), _solid((0.2, 0.3, 0.4))], ["a red square", "a blue sky"])
