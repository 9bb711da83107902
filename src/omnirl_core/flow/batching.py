"""Velocity over rows whose conditionings cannot share one batch.

Rows concatenate (``Conditioning.cat``) only when their ``Conditioning.signature`` agrees: a text prompt's padded
embeddings always do, an editing model's condition-image latents only when the images have the same size. The
trainer re-batches transitions freely, so it runs one ``velocity`` call per signature and puts the rows back in
order; rows that share one signature (every text-to-image batch) go through exactly the one call they always did.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from omnirl_core.contracts import Conditioning, FlowModel


def condition_groups(conds: Sequence[Conditioning], unconds: Sequence[Conditioning] | None = None) -> list[list[int]]:
    """Row indices grouped by conditioning signature (with the unconditional one's, when given), groups in order of
    their first row."""
    groups: dict[Hashable, list[int]] = {}
    for i, cond in enumerate(conds):
        key = (cond.signature, unconds[i].signature if unconds is not None else None)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def grouped_velocity(model: FlowModel, x: torch.Tensor, sigma: torch.Tensor, conds: Sequence[Conditioning],
                     guidance_scale: float = 1.0, unconds: Sequence[Conditioning] | None = None) -> torch.Tensor:
    """``model.velocity`` of the rows ``x`` (B, ...) at ``sigma`` (B,) with one-row conditionings ``conds`` (and
    ``unconds``): one call per group of rows that concatenate, the outputs in the rows' order (differentiable)."""
    device = model.device
    groups = condition_groups(conds, unconds)
    if len(groups) == 1:
        uncond = Conditioning.cat(list(unconds)).to(device) if unconds is not None else None
        return model.velocity(x, sigma, Conditioning.cat(list(conds)).to(device), guidance_scale, uncond)
    parts, order = [], []
    for rows in groups:
        index = torch.as_tensor(rows, device=x.device)
        uncond = Conditioning.cat([unconds[i] for i in rows]).to(device) if unconds is not None else None
        parts.append(model.velocity(x.index_select(0, index), sigma.index_select(0, index.to(sigma.device)),
                                    Conditioning.cat([conds[i] for i in rows]).to(device), guidance_scale, uncond))
        order += rows
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.as_tensor(order)] = torch.arange(len(order))
    out = torch.cat(parts)
    return out.index_select(0, inverse.to(out.device))
