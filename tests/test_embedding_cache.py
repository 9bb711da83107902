"""``trim_padding``: one prompt's conditioning without the padding a batch added, whatever its length."""

import torch

from omnirl_core.contracts import Conditioning
from omnirl_core.flow.embedding_cache import trim_padding


def _cond(embeds: torch.Tensor, mask: torch.Tensor) -> Conditioning:
    return Conditioning({"prompt_embeds": embeds, "prompt_mask": mask, "pooled": torch.ones(1, 4)},
                        pad_keys=("prompt_embeds", "prompt_mask"))


def test_trailing_padding_is_removed_and_inner_zeros_kept():
    embeds = torch.cat([torch.ones(1, 2, 4), torch.zeros(1, 1, 4), torch.ones(1, 1, 4), torch.zeros(1, 3, 4)], 1)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0]])
    out = trim_padding(_cond(embeds, mask))
    assert out.tensors["prompt_embeds"].shape == (1, 4, 4) and out.tensors["prompt_mask"].tolist() == [[1, 1, 1, 1]]
    assert torch.equal(out.tensors["pooled"], torch.ones(1, 4))


def test_an_empty_prompt_of_zero_length_is_left_as_it_is():
    out = trim_padding(_cond(torch.zeros(1, 0, 4), torch.zeros(1, 0, dtype=torch.long)))
    assert out.tensors["prompt_embeds"].shape == (1, 0, 4)
