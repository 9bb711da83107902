"""Rollout for AR models through transformers ``generate``, recording per-token log-probs.

Sampling happens inside a logits processor: it turns the step's logits into the sampling distribution with
the core's ``sampling_logprobs`` (the same function the trainer re-scores with), draws each row's token with
that request's own seeded generator, records the token's log-prob, and hands ``generate`` (run greedy) a
distribution concentrated on the drawn token. So the recorded log-prob is exactly that of the distribution
sampled, a request's tokens do not depend on its batch-mates, and ``generate`` still owns the KV cache,
multimodal prefill, padding and stopping.

A model that ``samples_itself`` (the Qwen3-Omni talker: one step is a frame of several codebooks) gets the same
prompts, sampling distribution and per-request generators through ``TokenModel.sample`` instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from pydantic import Field
from transformers import LogitsProcessor

from omnirl_core.ar.rollout import (
    PromptCache,
    TokenSamplingOptions,
    ar_sample,
    require_ar_model,
    sampling_params,
)
from omnirl_core.ar.sampling import SamplingParams, sample_tokens, sampling_logprobs
from omnirl_core.contracts import GenRequest, RolloutEngine, Sample


class TransformersRolloutOptions(TokenSamplingOptions):
    max_batch_size: int = Field(32, ge=1, description="Requests per generate call (left-padded together).")


class _SampleAndRecord(LogitsProcessor):
    """A transformers logits processor that samples (see the module docstring) and records (token, logp)."""

    def __init__(self, params: SamplingParams, generators: list[torch.Generator]):
        self.params = params
        self.generators = generators
        self.tokens: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = sampling_logprobs(scores, self.params)
        tokens = sample_tokens(logp, self.generators)
        self.tokens.append(tokens.cpu())
        self.logprobs.append(logp.gather(-1, tokens[:, None])[:, 0].cpu())
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(-1, tokens[:, None], 0.0)


@contextmanager
def _plain_generation_defaults(module: Any) -> Iterator[None]:
    """A checkpoint's ``generation_config.json`` fills every generate setting left unset (repetition penalty,
    suppressed tokens, ...): any such processor would change the logits behind our back. Run with none."""
    from transformers import GenerationConfig

    saved = module.generation_config
    module.generation_config = GenerationConfig()
    try:
        yield
    finally:
        module.generation_config = saved


class TransformersRolloutEngine(RolloutEngine):
    def __init__(self, model: Any, options: TransformersRolloutOptions | None, device: Any):
        require_ar_model(model, "transformers", calls_model_sampler=True)
        self.model = model
        self.options = options or TransformersRolloutOptions()
        self.device = torch.device(device)
        self.params = sampling_params(model, self.options)
        self._prompt = PromptCache(model, self.options.prompt_cache_size)

    def generate(self, requests: list[GenRequest]) -> Iterator[Sample]:
        size = self.options.max_batch_size
        for start in range(0, len(requests), size):
            yield from self._generate(requests[start:start + size])

    @torch.no_grad()
    def _generate(self, batch: list[GenRequest]) -> Iterator[Sample]:
        from transformers import GenerationConfig, LogitsProcessorList

        prompts = [self._prompt(r) for r in batch]
        if self.model.samples_itself:  # e.g. a talker's frames: the model runs its own loop, with our generators
            yield from self.model.sample(batch, prompts, self.params, [torch.Generator().manual_seed(r.seed)
                                                                       for r in batch])
            return
        inputs = self.model.model_inputs([p.input_ids for p in prompts], [p.media for p in prompts], side="left")
        recorder = _SampleAndRecord(self.params, [torch.Generator().manual_seed(r.seed) for r in batch])
        config = GenerationConfig(
            do_sample=False, max_new_tokens=self.params.max_new_tokens,
            eos_token_id=list(self.params.stop_token_ids), pad_token_id=self.model.pad_token_id,
        )
        module = self.model.module
        with _plain_generation_defaults(module):
            out = module.generate(**inputs, generation_config=config,
                                  logits_processor=LogitsProcessorList([recorder]))
        tokens = torch.stack(recorder.tokens, dim=1)
        logprobs = torch.stack(recorder.logprobs, dim=1)
        generated = out[:, inputs["input_ids"].shape[1]:].cpu()
        for b, (request, prompt) in enumerate(zip(batch, prompts)):
            sample = ar_sample(self.model, request, prompt, tokens[b], logprobs[b], self.params)
            n = len(sample.completion)
            if not torch.equal(generated[b, :n], sample.completion):
                raise RuntimeError("generate did not emit the sampled tokens: another logits processor or a "
                                   "forced token interfered with sampling")
            yield sample
