"""The reward contract: scores decoded samples, one float per sample (higher is better).

A reward plugin's factory returns a ``Reward`` built from its validated options. What a reward can do beyond
``__call__`` is declared here with a default, and the runtime reads the declaration: it never asks the object.
A plain function (or any callable) is accepted too and treated as a ``Reward`` with every default
(``as_reward``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ScoreDisplay:
    """A quantity an evaluation shows beside a reward's score, an affine function of it: ``scale * score +
    offset`` (asr-error's ``cer`` is ``1 - score``). Written per sample, per prompt and overall as
    ``<reward>/<name>`` (``asr-error/cer``); a negative ``scale`` means lower is better."""

    name: str
    scale: float = 1.0
    offset: float = 0.0

    def __call__(self, score: float) -> float:
        return self.scale * score + self.offset


class Reward(ABC):
    uses_inputs: bool = False
    """Compares against each prompt's data record (a reference answer, a media path): then called with
    ``inputs=[request.inputs, ...]`` as well."""

    batch_invariant: bool = False
    """Scores each sample on its own (a sample's score is the same whatever else shares its call): the executors
    then batch the samples that pile up, whatever ``run.reward_batching`` says."""

    asynchronous: bool = False
    """``submit`` is implemented: the reward scores on its own threads or event loop (a judge's HTTP requests),
    so an async reward actor awaits it without a thread of its own."""

    capacity: int = 1
    """With ``asynchronous``: how many samples it scores at once (e.g. a judge's requests in flight)."""

    display: ScoreDisplay | None = None
    """What an evaluation shows beside the score (a raw error rate where the score is 1 - error); None: the score
    alone. A reward whose display depends on its options overrides ``display_for`` instead."""

    @classmethod
    def display_for(cls, options: Any) -> ScoreDisplay | None:
        """The display of a reward built with ``options`` (its validated options, or None), read from the class
        without building the reward (an evaluation runs where the rewards are not, e.g. on Ray). ``display``
        by default."""
        return cls.display

    @abstractmethod
    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str], **kwargs: object) -> list[float]:
        """One score per sample. ``kwargs``: ``inputs`` for a reward that ``uses_inputs``."""

    def submit(self, outputs: Sequence[Any], prompts: Sequence[str],
               inputs: Sequence[dict[str, Any]] | None = None) -> Future[list[float]]:
        """Start the scoring and return its future at once (only where ``asynchronous`` is True)."""
        raise NotImplementedError(f"{type(self).__name__} is not asynchronous")

    def close(self) -> None:
        """Release what the reward holds (sessions, threads, servers) at the end of a run. Nothing by default."""


class CallableReward(Reward):
    """A plain callable ``fn(outputs, prompts) -> scores`` as a ``Reward`` with every default."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str], **kwargs: object) -> list[float]:
        return self.fn(outputs, prompts, **kwargs)

    def __repr__(self) -> str:
        return f"CallableReward({self.fn!r})"


def as_reward(obj: object) -> Reward:
    """A reward factory's result as a ``Reward``: itself, or a plain callable wrapped; anything else is a
    TypeError naming what it is."""
    if isinstance(obj, Reward):
        return obj
    if callable(obj):
        return CallableReward(obj)
    raise TypeError(f"a reward must be an omnirl_core.contracts.Reward or a callable, not {type(obj).__name__}")
