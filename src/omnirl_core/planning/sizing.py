"""Sizes of full-size models built on the ``meta`` device (no storage): parameter counts and the memory
training holds besides activations. Model plugins build their published architectures (``full_size.py``)
and call these; the arithmetic lives here once."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


class Published(NamedTuple):
    """A published parameter count: ``value`` as stated, to ``resolution`` (the unit of its last digit);
    ``truncated``: the figure is cut, not rounded, to that digit."""

    value: float
    resolution: float
    source: str
    truncated: bool = False


def published_counts(package: str, name: str = "published.toml") -> dict[tuple[str, str], Published]:
    """The published parameter counts a model plugin ships as data (``published.toml`` in its package), by
    ``(variant, component)``. Each ``[[count]]`` names its ``variants``, the ``component``, the ``value`` as
    stated, its ``resolution``, the ``source`` and optionally ``truncated``."""
    from importlib import resources

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib

    text = resources.files(package).joinpath(name).read_text(encoding="utf-8")
    table: dict[tuple[str, str], Published] = {}
    for entry in tomllib.loads(text)["count"]:
        published = Published(float(entry["value"]), float(entry["resolution"]), entry["source"],
                              bool(entry.get("truncated", False)))
        for variant in entry["variants"]:
            table[variant, entry["component"]] = published
    return table


def checkpoint_numel(module: torch.nn.Module) -> int:
    """Elements of the tensors a checkpoint of ``module`` holds: each parameter once, persistent buffers."""
    unique = {id(t): t for t in module.state_dict(keep_vars=True).values()}
    return sum(t.numel() for t in unique.values())


def lora_numel(module: torch.nn.Module, targets: tuple[str, ...] | str, rank: int) -> int:
    """Parameters of rank-``rank`` LoRA adapters, rank x (in + out) per adapted linear layer. ``targets``: names
    (a module whose name is one or ends with "." + one, as peft picks them) or one regex matched against the
    whole module name."""
    import torch

    picked = _picker(targets)
    return sum(rank * (m.in_features + m.out_features) for name, m in module.named_modules()
               if isinstance(m, torch.nn.Linear) and picked(name))


def _picker(targets: tuple[str, ...] | str) -> Callable[[str], object]:
    """Whether a module name is a LoRA target (``lora_numel``'s rule)."""
    if isinstance(targets, str):
        return re.compile(targets).fullmatch

    def picked(name: str) -> bool:
        return any(name == t or name.endswith("." + t) for t in targets)

    return picked


def lora_tensor_split_numel(module: torch.nn.Module, targets: tuple[str, ...] | str, rank: int,
                            column: tuple[str, ...], row: tuple[str, ...]) -> int:
    """Of ``lora_numel``'s adapters, the parameters a tensor-parallel engine splits over its ranks: ``B`` (out x rank)
    of a column-parallel layer (module names ending in one of ``column``: its output rows split), ``A`` (rank x in) of
    a row-parallel one (``row``: its input columns split); the other matrix of each it holds whole."""
    import torch

    picked = _picker(targets)
    total = 0
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.Linear) and picked(name):
            leaf = name.rsplit(".", 1)[-1]
            total += rank * m.out_features if leaf in column else rank * m.in_features if leaf in row else 0
    return total


def training_bytes(weights: dict[str, int], trainable: int, adapters: int, reference: int,
                   dtype_bytes: int) -> dict[str, int]:
    """What the torch train engine holds besides activations, in bytes: every component's weights
    (``weights/<name>``), the LoRA ``adapters`` (0 in full fine-tuning, whose weights are counted already), the
    ``gradients`` of the ``trainable`` parameters and AdamW's two moment buffers (``optimizer``), and a frozen
    ``reference`` copy (full fine-tuning with a KL term). Everything in the model dtype: peft gives adapters the
    base layer's dtype and AdamW keeps its states in the parameter's. ``total`` sums them."""
    out = {f"weights/{name}": n * dtype_bytes for name, n in weights.items()}
    out.update({"adapters": adapters * dtype_bytes, "gradients": trainable * dtype_bytes,
                "optimizer": 2 * trainable * dtype_bytes, "reference": reference * dtype_bytes})
    out["total"] = sum(out.values())
    return out


def trainable_numel(modules: Iterable[torch.nn.Module], lora_targets: tuple[str, ...] | str, lora_rank: int | None,
                    skip: Iterable[torch.nn.Module] = ()) -> int:
    """Parameters training updates in ``modules``: their LoRA adapters, or (``lora_rank`` None) every parameter
    but those of the ``skip`` modules (frozen towers). Buffers are never trained."""
    modules = list(modules)
    if lora_rank:
        return sum(lora_numel(m, lora_targets, lora_rank) for m in modules)
    frozen = {id(p) for tower in skip for p in tower.parameters()}
    return sum(p.numel() for m in modules for p in m.parameters() if id(p) not in frozen)


def check_variant(model: str, variant: str, variants: Sequence[str]) -> None:
    """A full-size build of ``model`` knows only its released ``variants``."""
    if variant not in variants:
        raise ValueError(f"unknown {model} variant {variant!r}; expected one of {tuple(variants)}")


def component_counts(components: dict[str, torch.nn.Module]) -> dict[str, int]:
    """``checkpoint_numel`` of every component of a pipeline, by component name."""
    return {name: checkpoint_numel(module) for name, module in components.items()}


def pipeline_training_bytes(components: dict[str, torch.nn.Module], trained: Sequence[str],
                            lora_targets: tuple[str, ...] | str, lora_rank: int | None, dtype_bytes: int,
                            reference: bool, skip: Iterable[torch.nn.Module] = ()) -> dict[str, int]:
    """``training_bytes`` of a pipeline of ``components`` that trains the ``trained`` ones: every component's
    weights; LoRA of ``lora_rank`` on ``lora_targets`` in each trained component (``lora_rank`` None: the trained
    components whole but the ``skip`` modules, their weights counted already); with full fine-tuning and a KL term
    (``reference``), a frozen copy of each trained component."""
    counts = component_counts(components)
    trainable = trainable_numel([components[name] for name in trained], lora_targets, lora_rank, skip)
    copies = sum(counts[name] for name in trained) if reference and not lora_rank else 0
    return training_bytes(counts, trainable, trainable if lora_rank else 0, copies, dtype_bytes)
