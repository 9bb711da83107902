"""A prompt-embedding cache for rollout engines: each distinct prompt is encoded once while the text
encoder's weights are unchanged, and every sample of that prompt (a whole group) shares the result.

Staleness: a model whose text encoder can change (trained, or reloaded) exposes an integer
``text_encoder_version`` and increments it on every change; the cache drops everything when it moves. A
model without the attribute has a frozen text encoder (the usual case: the denoiser is what RL trains).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from omnirl_core.contracts import Conditioning, FlowModel

Key = str | tuple[str, tuple[str, ...]]
"""A cache entry's key: the prompt, or (prompt, its condition images)."""


def text_encoder_version(model: FlowModel) -> int:
    """The model's text-encoder version counter (``PolicyModel.text_encoder_version``: 0 for a model that never
    changes its text encoder)."""
    return int(model.text_encoder_version)


def trim_padding(cond: Conditioning) -> Conditioning:
    """One row of conditioning without its trailing padding: the positions where every ``pad_keys`` tensor
    is zero ("not a token", the padding ``Conditioning.cat`` adds back). A prompt's conditioning then does
    not depend on which other prompts it was encoded with."""
    if not cond.pad_keys:
        return cond
    if len(cond) != 1:
        raise ValueError(f"trim_padding takes one row of conditioning, got {len(cond)}")
    used = None
    for key in cond.pad_keys:
        t = cond.tensors[key][0]
        row_used = t.ne(0).flatten(1).any(dim=1) if t.dim() > 1 else t.ne(0)  # a zero-length row too
        used = row_used if used is None else used | row_used
    assert used is not None  # pad_keys is not empty
    positions = used.nonzero()
    length = int(positions[-1]) + 1 if len(positions) else 1
    if length == used.shape[0]:
        return cond
    # clone, not a view: a prefix of the padded row is contiguous already and would keep (and pickle, e.g. to
    # a Ray actor) the whole padded storage
    return Conditioning(
        {k: v[:, :length].clone() if k in cond.pad_keys else v for k, v in cond.tensors.items()},
        cond.pad_keys, cond.layout,
    )


@dataclass
class EncodeStats:
    """Text-encoder work: ``calls`` to ``model.encode``, the ``prompts`` they encoded, cache ``hits``."""

    calls: int = 0
    prompts: int = 0
    hits: int = 0
    seconds: float = 0.0
    invalidations: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"calls": self.calls, "prompts": self.prompts, "hits": self.hits, "seconds": self.seconds,
                "invalidations": self.invalidations}


class EmbeddingCache:
    """Per-prompt conditioning, least recently used first out beyond ``max_entries``.

    ``max_entries=0`` turns caching off: every lookup encodes each of its prompts (duplicates included),
    which is what an engine without a cache does per request; kept for comparison.
    """

    def __init__(self, model: FlowModel, max_entries: int = 1024):
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.model = model
        self.max_entries = max_entries
        self.stats = EncodeStats()
        self._entries: OrderedDict[Key, Conditioning] = OrderedDict()
        self._version = text_encoder_version(model)

    def __len__(self) -> int:
        return len(self._entries)

    def invalidate(self) -> None:
        """Forget every entry (the text encoder changed without bumping ``text_encoder_version``)."""
        self._entries.clear()
        self.stats.invalidations += 1

    def lookup(self, prompts: Sequence[str], images: Sequence[tuple[str, ...]] | None = None) -> list[Conditioning]:
        """One-row conditioning per prompt, in order; missing prompts are encoded in a single call. ``images``: each
        prompt's condition images (``GenRequest.condition_images``) for a model that takes them; an entry is then
        kept per (prompt, images), shared by a group's samples."""
        if not prompts:
            return []
        keys: list[Key] = list(prompts) if images is None else [(p, tuple(i)) for p, i in zip(prompts, images)]
        if self.max_entries == 0:
            return self._encode(keys)
        version = text_encoder_version(self.model)
        if version != self._version:
            self.invalidate()
            self._version = version
        found: dict[Key, Conditioning] = {}
        for p in dict.fromkeys(keys):
            if p in self._entries:
                self._entries.move_to_end(p)
                found[p] = self._entries[p]
        self.stats.hits += sum(p in found for p in keys)
        missing = [p for p in dict.fromkeys(keys) if p not in found]
        if missing:
            for p, cond in zip(missing, self._encode(missing)):
                found[p] = self._entries[p] = cond
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return [found[p] for p in keys]

    def _encode(self, keys: list[Key]) -> list[Conditioning]:
        start = time.perf_counter()
        if all(isinstance(k, str) for k in keys):
            cond = self.model.encode([str(k) for k in keys])
            rows = [trim_padding(cond.select([i])) for i in range(len(keys))]
        else:  # (prompt, condition images): one row each, their layouts may differ
            pairs = [k if isinstance(k, tuple) else (k, ()) for k in keys]
            rows = [trim_padding(r) for r in self.model.encode_with_images([p for p, _ in pairs], [i for _, i in pairs])]
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += 1
        self.stats.prompts += len(keys)
        return rows
