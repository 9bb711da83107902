"""The model contracts: what the runtime, the engines and the algorithms call on a model plugin's object.

``PolicyModel`` is what every trained model offers (training setup, the trained weights, the reference policy);
``FlowModel`` adds the flow-matching step contract (encode, latent shape, sigmas, velocity, decode) and
``TokenModel`` the token-level one (prompts to token ids, per-token log-probs). Model plugins subclass the
kits built on them (``omnirl_core.flow.model.DiffusersFlowModel`` / ``DenoiserModel``,
``omnirl_core.ar.model.CausalLMPolicy``). Optional behaviour has a declared default here (a class attribute or a
method that does nothing), so the runtime calls it on every model and never asks whether it exists.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from omnirl_core.ar.sampling import SamplingParams, TokenPrompt
    from omnirl_core.config import LoraConfig
    from omnirl_core.contracts.data import Conditioning, GenRequest, Sample


class PolicyModel(ABC):
    """A trained policy: a flow model or a token model."""

    capabilities: frozenset[str] = frozenset()
    """What the model offers (``flow-matching``, ``cfg``, ``image``, ``video``, ``ar-text``, ...): algorithms and
    rewards declare what they need of it. The spec's ``capabilities`` is what resolution reads; the object's
    must agree."""

    device: torch.device
    dtype: torch.dtype
    lora: LoraConfig | None = None
    """The LoRA adapter being trained (set by ``setup_training``); None in full fine-tuning."""

    negative_prompt: str = ""
    """What rollout engines encode for the unconditional branch (``rollout.negative_prompt``; set by the worker)."""

    text_encoder_version: int = 0
    """Incremented on every change of the text encoder (trained or reloaded) by a model whose text encoder can
    change, so that cached prompt embeddings are dropped (``omnirl_core.flow.embedding_cache``). Left at 0: the
    text encoder is frozen."""

    lockstep: bool = False
    """Set by a sharded train engine when the model trains several modules: every call must then run each
    trained module (a rank with no input for one still joins its collectives)."""

    @abstractmethod
    def setup_training(self, lora: LoraConfig, need_reference: bool) -> None:
        """Freeze everything, then make trainable a fresh LoRA adapter (``lora.enabled``) or the trained
        network. ``need_reference``: keep a frozen copy as the reference policy (full fine-tuning)."""

    @abstractmethod
    def trained_modules(self) -> dict[str, torch.nn.Module]:
        """The modules training updates, by name (a sharded engine wraps each)."""

    def frozen_modules(self) -> list[torch.nn.Module]:
        """Modules never trained, used around the trained network (text encoders, VAE, media encoders):
        ``model.offload: cpu`` keeps them in host memory. None by default."""
        return []

    def called_submodules(self) -> list[torch.nn.Module]:
        """Submodules of the trained modules that the model calls by themselves, not only through their trained
        module's forward (a causal LM's decoder and output head: scoring takes logits only where it needs them). A
        sharding train engine (FSDP2) makes each a unit of its own, so that calling it gathers its parameters.
        They share no parameter. None by default: the model runs each trained module through its forward."""
        return []

    @abstractmethod
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates (LoRA weights, or the whole trained network)."""

    @abstractmethod
    def reference(self) -> AbstractContextManager[None]:
        """Within this context the model is the frozen reference policy (LoRA disabled / the base copy)."""

    @abstractmethod
    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights as CPU tensors that share no storage with the live ones (LoRA only when
        training LoRA)."""

    @abstractmethod
    def load_trained_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load ``trained_state_dict``'s output (weight sync, resume)."""

    @abstractmethod
    def save_trained(self, directory: Path, state: dict[str, torch.Tensor] | None = None) -> list[str]:
        """Write the trained weights in the layout the model's ecosystem reads back; returns the paths written
        (relative to ``directory``; a folder ends with ``/``). ``state``: write this full trained state instead
        of the module's own (a sharded engine gathers it first)."""

    @abstractmethod
    def load_trained(self, directory: Path) -> None:
        """Load what ``save_trained`` wrote."""


class FlowModel(PolicyModel):
    """The step contract every flow-matching model implements once; every flow algorithm then works.

    Time and sign conventions: ``sigma`` runs from 1 (pure noise) to 0 (data); ``x_sigma = (1 - sigma) x0 +
    sigma eps``; the velocity is ``v = eps - x0``, so an Euler step is ``x_next = x + (sigma_next - sigma) v``.
    """

    guidance: str = "cfg"
    """How ``guidance_scale`` acts: ``cfg`` true classifier-free guidance (``uncond`` is a second branch:
    ``v = v_u + g (v_c - v_u)``), ``embedded`` (the scale is an input of the network; ``uncond`` is ignored) or
    ``none``."""

    encodes_images: bool = False
    """Whether ``encode_images`` is implemented (offline preference data: Diffusion-DPO's image pairs)."""

    condition_images: int = 0
    """How many condition images (an edit's source, reference pictures: ``GenRequest.condition_images``) one prompt
    may carry: 0 for a text-to-image model; 1 for an editing model (Qwen-Image-Edit, FLUX.1 Kontext), more for a
    multi-image one (Qwen-Image-Edit-Plus). Where > 0, ``encode_with_images`` and ``condition_key`` are
    implemented, and the spec declares the ``image-input`` capability."""

    @abstractmethod
    def encode(self, prompts: list[str]) -> Conditioning:
        """Conditioning for a batch of prompts (cacheable per prompt while the text encoder is unchanged)."""

    def encode_with_images(self, prompts: list[str], images: Sequence[Sequence[str]]) -> list[Conditioning]:
        """One-row conditioning per prompt with its condition images (``images[i]``: prompt i's paths, possibly
        none): the text conditioning (a vision-language encoder sees the images too) and the images' latents that
        ``velocity`` reads beside the noisy ones, their grids as the ``Conditioning.layout`` (rows of other layouts
        cannot be concatenated, hence a list). Deterministic, and cacheable per (prompt, images): it is the same for
        every sample of a group and every step, so the rollout encodes it once per group and the trainer
        re-evaluates with the rollout's own (``Sample.cond``). Only where ``condition_images`` > 0."""
        raise NotImplementedError(f"{type(self).__name__} takes no condition images (condition_images is 0)")

    def condition_key(self, request: GenRequest) -> Hashable:
        """What requests must share, besides their latent shape and guidance scale, to run in one ``velocity`` call:
        an editing model's condition-image latent grids, found from its images' sizes without encoding them. It
        equals the ``Conditioning.layout`` of the request's encoding (the rollout engines bucket requests by it
        before they encode). None for a model without condition images."""
        return None

    @abstractmethod
    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        """Per-sample latent shape for an output size."""

    @abstractmethod
    def sigmas(self, num_steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """The model's (shifted) sigma schedule: ``num_steps + 1`` values from 1 down to 0, fp32."""

    @abstractmethod
    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning,
                 guidance_scale: float = 1.0, uncond: Conditioning | None = None) -> torch.Tensor:
        """One batched network call (two with true CFG), fp32 out."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> outputs in [0, 1]: images (B, 3, H, W) or videos (B, 3, F, H, W)."""

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] at a size the model generates -> latents on the flow path's data end
        (x0), fp32, deterministic (the encoder's mean). Only where ``encodes_images`` is True."""
        raise NotImplementedError(f"{type(self).__name__} does not encode images (encodes_images is False)")


class TokenModel(PolicyModel):
    """The token-level contract of autoregressive (AR / omni) models: prompts to token ids, and the log-probs of
    sampled tokens under the sampling distribution (``omnirl_core.ar.sampling``), identical in rollout and
    trainer."""

    @abstractmethod
    def encode_prompt(self, request: GenRequest) -> TokenPrompt:
        """The request's prompt as a ``TokenPrompt`` (chat template, generation prompt, media features)."""

    @abstractmethod
    def token_logprobs(self, prompts: Sequence[TokenPrompt], completions: Sequence[torch.Tensor],
                       params: Sequence[SamplingParams]) -> list[torch.Tensor]:
        """Per-token log-probs of ``completions`` after ``prompts`` under each row's ``SamplingParams``."""

    def token_logprobs_under(self, prompts: Sequence[TokenPrompt], completions: Sequence[torch.Tensor],
                             distributions: Sequence[Sequence[SamplingParams]]) -> list[list[torch.Tensor]]:
        """``token_logprobs`` under several distributions (``distributions[k]`` holds each row's
        ``SamplingParams``), e.g. the sampling distribution for the ratio and the same without its top-k / top-p
        cut for a KL term. This default scores once per distribution; a model that can take every distribution
        from one forward pass overrides it (``CausalLMPolicy`` does)."""
        return [self.token_logprobs(prompts, completions, params) for params in distributions]

    @abstractmethod
    def decode(self, ids: torch.Tensor) -> str:
        """Token ids -> text."""

    logprob_parts: tuple[str, ...] = ()
    """The modules whose draws make up a completion, by name, when there are several (a thinker's reply tokens then a
    talker's speech frames, trained jointly): a sample's log-prob is the sum over all of them, and the token algorithms
    log each part's share and its rollout-vs-trainer gap (``logprob/<part>/...``; ``logprob_part_of`` says which entry
    is whose). Empty: one module."""

    def logprob_part_of(self, completion: torch.Tensor) -> torch.Tensor:
        """For each log-prob entry of ``completion`` (a sample's, as the rollout stored it), the index into
        ``logprob_parts`` of the module that drew it: a (T,) long tensor. Only where ``logprob_parts`` is set."""
        raise NotImplementedError(f"{type(self).__name__} has one log-prob part (logprob_parts is empty)")

    samples_itself: bool = False
    """True for a model whose completions a generic token sampler cannot draw (a speech talker: every step is a
    frame of several codebooks from two networks): a rollout engine that supports it calls ``sample`` instead of its
    own generation loop; the others refuse the model."""

    def sample(self, requests: Sequence[GenRequest], prompts: Sequence[TokenPrompt], params: SamplingParams,
               generators: Sequence[torch.Generator]) -> list[Sample]:
        """The finished samples of one batch of requests, drawn by the model (only where ``samples_itself``):
        request i with ``generators[i]`` alone, so that it does not depend on its batch-mates; each sample's
        ``logprobs`` are those ``token_logprobs`` recomputes for its ``completion`` under ``params``."""
        raise NotImplementedError(f"{type(self).__name__} does not sample by itself (samples_itself is False)")
