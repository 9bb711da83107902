"""Token sampling math shared by AR model plugins, the rollout engines that sample from them and the token
algorithms (GSPO, GRPO).

One function, ``sampling_logprobs``, defines the distribution a token is drawn from (allowed-token mask,
temperature, top-k, top-p, in that order, in fp32). The rollout engine samples from it and records the
log-prob of each sampled token; the trainer re-scores the same tokens through it (``token_logprobs``). With
the same weights both give the same numbers up to float error, whatever processors were used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from omnirl_core.contracts.data import Sample

P = TypeVar("P")


@dataclass(frozen=True)
class SamplingParams:
    """The distribution completions are sampled from; stored with every sample so the trainer re-scores
    exactly that distribution."""

    temperature: float = 1.0
    top_k: int = 0
    """Keep the k most likely tokens (0: off)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches p (1.0: off)."""
    max_new_tokens: int = 256
    allowed_token_ids: tuple[int, ...] | None = None
    """Sample only among these tokens (guided choice); None: the whole vocabulary."""
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature} (greedy decoding has no log-probs "
                             "to train on)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def untruncated(params: P) -> P:
    """The sampling distribution before its top-k / top-p cut (allowed tokens and temperature kept): the support
    a KL term compares policies on, where a token sampled earlier never has probability 0. Anything that is not
    ``SamplingParams`` (a test's stand-in) passes through."""
    return replace(params, top_k=0, top_p=1.0) if isinstance(params, SamplingParams) else params


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probs (fp32, last dim = vocabulary) of the distribution tokens are sampled from.

    Masked tokens get -inf. The masks are functions of the logits, so the trainer recomputes them under the
    current weights: the re-scored distribution is the one the current policy would sample.
    """
    x = logits.float()
    if params.allowed_token_ids is not None:
        allowed = torch.zeros(x.shape[-1], dtype=torch.bool, device=x.device)
        allowed[list(params.allowed_token_ids)] = True
        x = x.masked_fill(~allowed, float("-inf"))
    if params.temperature != 1.0:
        x = x / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x.detach(), params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x.detach() < kth, float("-inf"))
    if params.top_p < 1.0:
        probs, order = torch.sort(torch.softmax(x.detach(), dim=-1), dim=-1, descending=True)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above
        drop_sorted = mass_before >= params.top_p  # the most likely token is always kept (mass_before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def sample_tokens(logprobs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of ``logprobs`` (B, V), row b drawn with its own generator: a request's tokens do
    not depend on which other requests share its batch."""
    # inverse CDF in float64: one uniform per row (multinomial over a 150k vocabulary is ~100x slower on CPU);
    # a masked token has a zero-width interval and is never drawn
    cdf = torch.cumsum(logprobs.detach().double().exp(), dim=-1).cpu()
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators]) * cdf[:, -1]
    picks = torch.searchsorted(cdf, u[:, None], right=True)[:, 0].clamp_max(cdf.shape[-1] - 1)
    return picks.to(logprobs.device)


@dataclass
class TokenPrompt:
    """A prompt ready for the model: token ids (media placeholders expanded) and the media features."""

    input_ids: torch.Tensor  # (P,) long
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    """Model-specific features of this prompt's images / audio (e.g. pixel_values, input_features)."""


def pad_sequences(seqs: Sequence[torch.Tensor], value: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids padded on ``side`` ('left' for generation, 'right' for scoring) and the attention mask."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), value, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        span = slice(length - len(s), length) if side == "left" else slice(0, len(s))
        ids[i, span] = s
        mask[i, span] = 1
    return ids, mask


def completion_tokens(sample: Sample) -> torch.Tensor:
    """The sampled completion of an AR sample (stop token included), as the rollout engine stored it."""
    assert sample.completion is not None, "not a token sample: it has no completion"
    return sample.completion
