"""The data that crosses every seam: a rollout plan, a request, a finished sample (its typed trajectory) and a
batch of conditioning. Plain data; torch is imported lazily by the types that hold tensors."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from omnirl_core.ar.sampling import SamplingParams, TokenPrompt


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

    @property
    def condition_images(self) -> tuple[str, ...]:
        """The prompt's condition images (an edit's source, reference pictures), in order: the paths in its
        record's ``image`` field (one path or a list; the data layer makes them absolute and checks they open);
        () for a text-only prompt. An image-conditioned flow model (``FlowModel.condition_images`` > 0) encodes
        them with the prompt; a reward that compares against the source reads them
        (``omnirl_core.rewards_kit.sources``)."""
        return condition_paths(self.inputs.get(CONDITION_IMAGE_FIELD))


CONDITION_IMAGE_FIELD = "image"
"""The prompt-record field that holds a prompt's condition images (a path or a list of paths)."""
MEDIA_KEYS = (CONDITION_IMAGE_FIELD, "audio", "video", "mask", "voice")
"""Record fields that hold paths (a path or a list of paths; relative to the data file, made absolute when read):
``mask`` marks the region an edit may change, ``voice`` is a reference voice to speak in; both for rewards."""


def media_paths(record: dict[str, Any] | None) -> list[str]:
    """Every path a record's media fields (``MEDIA_KEYS``) name, in field order, each once."""
    paths: dict[str, None] = {}
    for key in MEDIA_KEYS:
        paths.update(dict.fromkeys(condition_paths((record or {}).get(key))))
    return list(paths)


def condition_paths(value: object) -> tuple[str, ...]:
    """A record's ``image`` value (None, one path or a list of paths) as a tuple of paths."""
    if value is None or value == "":
        return ()
    items = value if isinstance(value, (list, tuple)) else [value]
    return tuple(str(v) for v in items if v not in (None, ""))


@dataclass(frozen=True)
class Speech:
    """A spoken sample, a speech model's decoded output (``Sample.output``) and what audio rewards score: a mono
    waveform (1-D float32 tensor in [-1, 1], on the CPU) at ``sample_rate`` Hz, with the text it speaks (the
    prompt for text-to-speech; the thinker's answer when the text was generated in the same rollout)."""

    waveform: torch.Tensor
    sample_rate: int
    text: str

    def __post_init__(self) -> None:
        if self.waveform.dim() != 1:
            raise ValueError(f"a Speech waveform is 1-D (mono samples), not of shape {tuple(self.waveform.shape)}")
        if self.sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, not {self.sample_rate}")

    @property
    def duration_s(self) -> float:
        return self.waveform.numel() / self.sample_rate


TRAJECTORY_FIELDS = ("latents", "sigmas", "logprobs", "cond", "uncond", "prompt_tokens", "completion", "sampling")
"""The ``Sample`` fields that make up its trajectory: what a worker keeps and the update reads."""


@dataclass
class Sample:
    """A finished rollout: its typed trajectory (what the trainer re-evaluates), the decoded output and its
    rewards. A rollout engine fills the trajectory fields of its model kind; the trainer reads only them.

    Flow models: ``latents``, ``sigmas``, ``logprobs`` and the conditioning the rollout used (``cond``, and
    ``uncond`` when the sample was guided with true CFG). Token models: ``prompt_tokens`` (the model's
    ``TokenPrompt``), ``completion`` (the sampled ids), ``sampling`` (the distribution's ``SamplingParams``) and
    ``logprobs`` (one per completion token)."""

    request: GenRequest
    latents: torch.Tensor | None  # (T + 1, *latent_shape) fp32, x_0 = initial noise ... x_T = final latent (AR: None)
    sigmas: torch.Tensor | None  # (T + 1,) fp32 (None for AR)
    logprobs: torch.Tensor | None  # (T,) fp32, NaN for ODE steps; per-token log-probs for AR models
    output: torch.Tensor | str | Speech | None  # decoded: image (3, H, W) in [0, 1], video (3, F, H, W), text, speech
    rewards: dict[str, float] = field(default_factory=dict)
    reward: float = float("nan")
    advantage: float = 0.0
    cond: Conditioning | None = None
    """Flow: the prompt's conditioning (one row) the rollout's velocity calls used."""
    uncond: Conditioning | None = None
    """Flow with ``guidance_scale`` > 1: the negative prompt's conditioning (one row), which the trainer passes back to
    ``velocity`` (a model with true CFG runs it as the unconditional branch; embedded guidance ignores it); None at
    scale 1. With condition images, the negative prompt encoded with the same images (their latents included), as
    the editing pipelines' unconditional branch sees them."""
    prompt_tokens: TokenPrompt | None = None
    """Token models: the ``omnirl_core.ar.sampling.TokenPrompt`` the completion was sampled after."""
    completion: torch.Tensor | None = None
    """Token models: the sampled token ids (1-D long tensor), stop token included when one was sampled. A model that
    samples itself (``TokenModel.samples_itself``) may store another layout its ``token_logprobs`` reads, one row
    per ``logprobs`` entry (a talker's (T, K) codec frames)."""
    sampling: SamplingParams | None = None
    """Token models: the ``SamplingParams`` (temperature, top-k, top-p) of the distribution sampled from."""
    extras: dict[str, Any] = field(default_factory=dict)
    """The runtime's and the algorithms' bookkeeping (rollout-correction records, a Ray worker's held key, an
    algorithm's own notes); never part of the trajectory."""

    @property
    def prompt(self) -> str:
        return self.request.prompt

    @property
    def condition_images(self) -> tuple[str, ...]:
        """The request's condition images (``GenRequest.condition_images``): an edit's source."""
        return self.request.condition_images


@dataclass
class Conditioning:
    """A batch of model conditioning: tensors with the batch on dim 0.

    Tensors named in ``pad_keys`` are sequences (dim 1) padded with zeros when batches are concatenated
    (their masks, also in ``pad_keys``, pad with zeros = "not a token"). ``layout`` is structure every row shares
    that no tensor shape tells (an editing model's condition-image latent grids: their token counts alone do not
    place them); rows concatenate only with equal layouts.
    """

    tensors: dict[str, torch.Tensor]
    pad_keys: tuple[str, ...] = ()
    layout: Hashable = None

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    @property
    def signature(self) -> Hashable:
        """What rows must share to be concatenated (``cat``) into one batch: every tensor's name, the per-row shape
        of those not padded (None for the padded sequences, whose lengths may differ), and the ``layout``. A
        text-to-image model's rows all share one; an editing model's condition images make it follow their sizes."""
        shapes = tuple(sorted((k, None if k in self.pad_keys else tuple(v.shape[1:])) for k, v in self.tensors.items()))
        return shapes, self.layout

    def select(self, index: Sequence[int]) -> Conditioning:
        import torch

        idx = torch.as_tensor(list(index), dtype=torch.long)
        return Conditioning({k: v.index_select(0, idx.to(v.device)) for k, v in self.tensors.items()},
                            self.pad_keys, self.layout)

    def to(self, device: torch.device | str) -> Conditioning:
        return Conditioning({k: v.to(device) for k, v in self.tensors.items()}, self.pad_keys, self.layout)

    @staticmethod
    def cat(items: Sequence[Conditioning]) -> Conditioning:
        import torch

        first = items[0]
        if any(c.layout != first.layout for c in items):
            raise ValueError(f"conditionings of different layouts cannot share a batch: "
                             f"{sorted({repr(c.layout) for c in items})}")
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
        return Conditioning(out, first.pad_keys, first.layout)
