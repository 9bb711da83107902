"""The contracts between plugins: requests, samples, conditioning, and the model / reward / algorithm /
engine protocols. Plain data and typing only; torch is imported lazily by the types that hold tensors."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RolloutPlan:
    """How one sample is rolled out: a sampler kind per denoising step and the steps that are trained.

    ``step_kinds[i]`` is 'ode', 'sde', 'cps', 'dance' or 'dpm2' (second-order multistep ODE). Steps in
    ``train_steps`` must be stochastic.
    """

    step_kinds: tuple[str, ...]
    train_steps: tuple[int, ...]
    eta: float = 0.0
    shared_initial_noise: bool = False
    """All samples of a group start from the same initial noise (DanceGRPO)."""
    sigma_indices: tuple[int, ...] | None = None
    """A subset of a finer schedule (MixGRPO-Flash: fewer, second-order steps after the SDE window): the
    model's schedule is computed for ``schedule_steps`` steps and the plan's ``num_steps + 1`` sigmas are
    the ones at these indices (0 first, ``schedule_steps`` last). None: the schedule of ``num_steps``."""

    def __post_init__(self) -> None:
        for i in self.train_steps:
            if not 0 <= i < len(self.step_kinds):
                raise ValueError(f"train step {i} outside 0..{len(self.step_kinds) - 1}")
            if self.step_kinds[i] in ("ode", "dpm2"):
                raise ValueError(f"train step {i} is an ODE step: it has no log-prob")
        idx = self.sigma_indices
        if idx is not None and (len(idx) != len(self.step_kinds) + 1 or idx[0] != 0
                                or any(b <= a for a, b in itertools.pairwise(idx))):
            raise ValueError(f"sigma_indices {idx} must rise from 0 and hold num_steps + 1 entries")

    @property
    def num_steps(self) -> int:
        return len(self.step_kinds)

    @property
    def schedule_steps(self) -> int:
        """How many steps the model's sigma schedule is computed for (``sigmas_from`` then subsets it)."""
        return self.num_steps if self.sigma_indices is None else self.sigma_indices[-1]

    def sigmas_from(self, schedule: torch.Tensor) -> torch.Tensor:
        """The plan's sigmas out of the model's schedule for ``schedule_steps`` steps."""
        return schedule if self.sigma_indices is None else schedule[list(self.sigma_indices)]


@dataclass
class GenRequest:
    """One sample to generate. Seeds make it reproducible whatever else shares its batches."""

    uid: int
    prompt: str
    prompt_index: int
    group: int
    seed: int
    height: int
    width: int
    plan: RolloutPlan
    guidance_scale: float = 1.0
    num_frames: int | None = None
    noise_seed: int | None = None
    """Seed of the initial latent; samples of a group share it when the algorithm asks (DanceGRPO)."""
    arrival_s: float = 0.0
    inputs: dict[str, Any] = field(default_factory=dict)
    """The prompt's data record besides the text: media paths (``image``, ``audio``) for models that read
    them, reference answers for rewards that compare against one (see ``omnirl_core.data.sources``)."""


@dataclass
class Sample:
    """A finished rollout: the trajectory, its log-probs, the decoded output and its rewards."""

    request: GenRequest
    latents: Any  # (T + 1, *latent_shape) fp32, x_0 = initial noise ... x_T = final latent (None for AR)
    sigmas: Any  # (T + 1,) fp32 (None for AR)
    logprobs: Any  # (T,) fp32, NaN for ODE steps; per-token log-probs for AR models
    output: Any  # decoded output: image (3, H, W) in [0, 1], video (3, F, H, W), or text (str)
    rewards: dict[str, float] = field(default_factory=dict)
    reward: float = float("nan")
    advantage: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        return self.request.prompt


@dataclass
class Conditioning:
    """A batch of model conditioning: tensors with the batch on dim 0.

    Tensors named in ``pad_keys`` are sequences (dim 1) padded with zeros when batches are concatenated
    (their masks, also in ``pad_keys``, pad with zeros = "not a token").
    """

    tensors: dict[str, Any]
    pad_keys: tuple[str, ...] = ()

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def select(self, index: Sequence[int]) -> Conditioning:
        import torch

        idx = torch.as_tensor(list(index), dtype=torch.long)
        return Conditioning({k: v.index_select(0, idx.to(v.device)) for k, v in self.tensors.items()},
                            self.pad_keys)

    def to(self, device: Any) -> Conditioning:
        return Conditioning({k: v.to(device) for k, v in self.tensors.items()}, self.pad_keys)

    @staticmethod
    def cat(items: Sequence[Conditioning]) -> Conditioning:
        import torch

        first = items[0]
        out = {}
        for key in first.tensors:
            parts = [c.tensors[key] for c in items]
            if key in first.pad_keys:
                length = max(p.shape[1] for p in parts)
                parts = [
                    torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, length - p.shape[1]))
                    if p.shape[1] < length else p
                    for p in parts
                ]
            out[key] = torch.cat(parts, dim=0)
        return Conditioning(out, first.pad_keys)


@runtime_checkable
class FlowModel(Protocol):
    """The step contract every flow-matching model implements once; every flow algorithm then works.

    Optional attribute ``text_encoder_version: int``: a model whose text encoder can change (trained or
    reloaded) increments it on every change, so that cached prompt embeddings are dropped
    (``omnirl_core.flow.embedding_cache``). Without it the text encoder is taken to be frozen.

    Optional attribute ``guidance``: "cfg" (true classifier-free guidance, the default), "embedded" (the scale
    is an input of the network; ``uncond`` is ignored) or "none".
    """

    capabilities: frozenset[str]

    def encode(self, prompts: list[str]) -> Conditioning:
        """Conditioning for a batch of prompts (cacheable per prompt while the text encoder is unchanged)."""

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        """Per-sample latent shape for an output size."""

    def sigmas(self, num_steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """The model's (shifted) sigma schedule: ``num_steps + 1`` values from 1 down to 0, fp32."""

    def velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        guidance_scale: float = 1.0,
        uncond: Conditioning | None = None,
    ) -> torch.Tensor:
        """One batched transformer call (two with CFG; the unconditional branch without grad), fp32 out."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> outputs in [0, 1]: images (B, 3, H, W) or videos (B, 3, F, H, W)."""

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates (LoRA weights, or the whole denoiser)."""

    def reference(self) -> AbstractContextManager[None]:
        """Within this context ``velocity`` is the frozen reference policy (LoRA disabled / base copy)."""


@runtime_checkable
class EncodesImages(Protocol):
    """Optional model capability: images to latents (offline preference data, e.g. Diffusion-DPO).

    ``images`` are (B, 3, H, W) in [0, 1] at a size the model generates; the latents have the per-sample
    shape of ``latent_shape(H, W)`` and lie on the flow path's data end (x0), fp32. Deterministic (the
    encoder's mean), so the same image always gives the same latent."""

    def encode_images(self, images: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class Reward(Protocol):
    """Scores decoded samples. Returns one float per sample (higher is better).

    A reward that compares against each prompt's data record (a reference answer) sets the class attribute
    ``uses_inputs = True`` and is then called with ``inputs=[request.inputs, ...]`` as well.
    """

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str]) -> list[float]: ...


class RolloutEngine(Protocol):
    def generate(self, requests: list[GenRequest]) -> Iterator[Sample]:
        """Generate every request; yields finished samples as they complete (possibly out of order)."""
