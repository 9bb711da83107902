"""Shadow copies of the trained parameters: an exponential moving average (DiffusionNFT's sampler policy)
or a plain snapshot (an online reference refreshed every k steps, Diffusion-DPO).

Works on ``model.trainable_parameters()`` only, so it is the same for LoRA (the adapter weights) and full
fine-tuning, for every model. ``swapped`` puts the shadow weights into the live parameters for a while
(rollout, or a no-grad forward) and restores the trained ones afterwards; the optimizer never sees it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class ShadowParameters:
    def __init__(self, params: list[torch.nn.Parameter]):
        if not params:
            raise ValueError("no parameters to shadow: the model has no trainable parameters")
        self.params = list(params)
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """shadow <- decay * shadow + (1 - decay) * theta; decay 0 copies theta."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must lie in [0, 1], got {decay}")
        for s, p in zip(self.shadow, self.params):
            s.mul_(decay).add_(p.detach().to(s.dtype), alpha=1.0 - decay)

    @torch.no_grad()
    def copy_from_params(self) -> None:
        self.update(0.0)

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Within this context the live parameters hold the shadow weights."""
        with torch.no_grad():
            trained = [p.detach().clone() for p in self.params]
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, t in zip(self.params, trained):
                    p.copy_(t)

    def distance(self) -> float:
        """RMS difference between the shadow and the live parameters (a metric: how far the sampler lags)."""
        total, count = 0.0, 0
        for s, p in zip(self.shadow, self.params):
            total += float(((s - p.detach()) ** 2).sum())
            count += s.numel()
        return (total / max(count, 1)) ** 0.5

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"shadow.{i}": s.detach().cpu().contiguous() for i, s in enumerate(self.shadow)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if len(state) != len(self.shadow):
            raise ValueError(f"shadow state holds {len(state)} tensors, the model has {len(self.shadow)}")
        for i, s in enumerate(self.shadow):
            s.copy_(state[f"shadow.{i}"])
