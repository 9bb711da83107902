"""Rollout over the flow-model contract with the core sampler.

Requests that can share a model call (same latent shape, CFG scale and plan) are batched, up to
``max_batch_size``. Every request draws its noise from its own seeded generator, so a sample does not
depend on which other requests shared its batches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.interfaces import Conditioning, GenRequest, Sample
from omnirl_core.sampler import sample_step


class DiffusersRolloutOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_batch_size: int = Field(32, ge=1, description="Requests per model call.")


def _request_noise(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


class DiffusersRolloutEngine:
    def __init__(self, model: Any, options: DiffusersRolloutOptions | None, device: Any):
        self.model = model
        self.options = options or DiffusersRolloutOptions()
        self.device = torch.device(device)

    def conditioning(self, prompts: list[str]) -> dict[str, Conditioning]:
        unique = list(OrderedDict.fromkeys(prompts))
        cond = self.model.encode(unique)
        return {p: cond.select([i]) for i, p in enumerate(unique)}

    def generate(self, requests: list[GenRequest]) -> Iterator[Sample]:
        if not requests:
            return
        cond = self.conditioning([r.prompt for r in requests])
        uncond = None
        if any(r.guidance_scale > 1.0 for r in requests):
            uncond = self.model.encode([getattr(self.model, "negative_prompt", " ")])
        buckets: dict[tuple, list[GenRequest]] = OrderedDict()
        for r in requests:
            key = (self.model.latent_shape(r.height, r.width, r.num_frames), r.guidance_scale, r.plan)
            buckets.setdefault(key, []).append(r)
        for (shape, _, _), bucket in buckets.items():
            for start in range(0, len(bucket), self.options.max_batch_size):
                yield from self._denoise(bucket[start:start + self.options.max_batch_size], shape, cond, uncond)

    @torch.no_grad()
    def _denoise(self, batch: list[GenRequest], shape: tuple[int, ...], cond: dict[str, Conditioning],
                 uncond: Conditioning | None) -> Iterator[Sample]:
        plan = batch[0].plan
        n = len(batch)
        sigmas = self.model.sigmas(plan.num_steps, shape)
        x = torch.stack([_request_noise(r.noise_seed if r.noise_seed is not None else r.seed, shape)
                         for r in batch]).to(self.device)
        step_gens = [torch.Generator().manual_seed(r.seed + 1) for r in batch]
        batch_cond = Conditioning.cat([cond[r.prompt] for r in batch]).to(self.device)
        batch_uncond = Conditioning.cat([uncond] * n).to(self.device) if uncond is not None else None
        trajectory = [x.float().cpu()]
        logprobs = torch.full((n, plan.num_steps), float("nan"))
        sigma_max = sigmas[1].expand(n).to(self.device)
        for i, kind in enumerate(plan.step_kinds):
            s = sigmas[i].expand(n).to(self.device)
            s_next = sigmas[i + 1].expand(n).to(self.device)
            v = self.model.velocity(x, s, batch_cond, batch[0].guidance_scale, batch_uncond)
            noise = None
            if kind != "ode":
                noise = torch.stack([torch.randn(shape, generator=g) for g in step_gens]).to(self.device)
            out = sample_step(kind, x, v, s, s_next, plan.eta, noise, sigma_max)
            x = out.prev_sample
            trajectory.append(x.cpu())
            if out.logprob is not None:
                logprobs[:, i] = out.logprob.cpu()
        images = self.model.decode(x)
        latents = torch.stack(trajectory, dim=1)
        for j, r in enumerate(batch):
            yield Sample(request=r, latents=latents[j], sigmas=sigmas.clone(), logprobs=logprobs[j].clone(),
                         output=images[j],
                         extras={"cond": cond[r.prompt], "uncond": uncond})
