"""Guided choice (``allowed_tokens``) inside SGLang: a custom logit processor that keeps a request's allowed ids.

Imported by the server only, in the SGLang environment. SGLang's sampler runs custom logit processors on the
raw logits before the temperature, the top-k / top-p cut and the log-probs it returns, which is the trainer's
order (``omnirl_core.ar.sampling.sampling_logprobs``: mask, temperature, cut): the ``output_token_logprobs`` of
a masked request are the log-probs renormalised over the allowed tokens.

SGLang takes a processor as a dill string (``CustomLogitProcessor.to_str``) that its scheduler loads. The
server builds that string itself from this class, which dill stores by reference (``omnirl_plugin_sglang.
guided.AllowedTokens``; the scheduler, a child of the server, imports it from the same environment); over
the network the server takes only the allowed token ids, never a processor.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

PARAM = "allowed_token_ids"


class AllowedTokens(CustomLogitProcessor):
    """Every logit but the row's ``allowed_token_ids`` (its custom parameter) set to -inf."""

    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None) -> torch.Tensor:
        keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        for row, params in enumerate(custom_param_list or []):
            keep[row, torch.tensor(params[PARAM], dtype=torch.long, device=logits.device)] = True
        return logits.masked_fill(~keep, float("-inf"))


def processor() -> str:
    """The processor as SGLang's request field ``custom_logit_processor`` takes it."""
    return AllowedTokens.to_str()
