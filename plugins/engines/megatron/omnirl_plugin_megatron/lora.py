"""LoRA on the megatron thinker: the transformers thinker's peft adapters on the attention projections
(``self_attn.{q,k,v,o}_proj``), as adapters on megatron's fused ``linear_qkv`` (column parallel) and ``linear_proj``
(row parallel) that compute what the unsplit adapters compute.

peft adds ``scale * B (A x)`` to each adapted projection (Hu et al. 2021, eq. 3; ``scale = alpha / rank``, no
dropout). On megatron's tensor-parallel layers:

- ``linear_qkv``: its output rows are, per query group, [the group's q heads; its k head; its v head], split over
  the tensor-parallel ranks by query groups. One adapter per adapted projection p of q, k, v: ``A_p`` whole on
  every rank, ``B_p`` split with the output rows (its rows are heads in order, so a rank's query groups are one
  contiguous chunk of them). ``a_p = A_p x`` on every rank; its gradient, which a rank sees only through its own
  rows of ``B_p``, is summed over the group (``copy_to_tensor_model_parallel_region``: identity forward,
  all-reduce backward), so every rank gets ``A_p``'s whole gradient, and x's gradient through the adapter is whole
  (megatron sums the base layer's own). The three deltas are interleaved in the fused per-group order.
- ``linear_proj``: its input columns are this rank's heads. ``A_o`` is split with the input columns and its partial
  products summed over the group (``reduce_from_tensor_model_parallel_region``: all-reduce forward, identity
  backward); ``B_o`` is whole on every rank. The output's gradient is the same on every rank, so ``B_o``'s is too.

So an adapter held whole gets the same gradient on every tensor-parallel rank: gradients are summed over the
data-parallel ranks only, as the dense weights'. The adapters take the dtype of peft's (float32: the worker upcasts
them before the engine starts) and the branch runs in it, its sum cast back to the layer's dtype, as peft's does.

Names: the peft name ``model.language_model.layers.{i}.self_attn.{p}_proj.lora_{A,B}.weight`` is the megatron
parameter ``decoder.layers.{i}.self_attention.linear_{qkv,proj}.lora_{A,B}.{p}``; the split rules are
``thinker.split_rule``'s, so ``thinker.shard`` / ``unshard`` move adapters between layouts as they move weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from omnirl_core.errors import UsageError

PEFT_NAME = re.compile(r"^model\.language_model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.lora_([AB])\.weight$")
MEGATRON_NAME = re.compile(r"^decoder\.layers\.(\d+)\.self_attention\.linear_(qkv|proj)\.lora_([AB])\.([qkvo])$")
MODULE_OF = re.compile(r"\.(lora_[A-Za-z_]+|base_layer)(\..*)?$|\.(weight|bias)$")
QKV = "qkv"


def adapted(peft_names: list[str]) -> dict[int, list[str]]:
    """The adapted projections of each decoder layer (``{layer: ['q', 'v', ...]}``) from the peft names of the
    transformers thinker's adapters; anything else (the MoE router, an output head, the vision or audio encoders)
    is refused by name: megatron holds the text decoder only, and only its attention gets adapters here."""
    layers: dict[int, set[str]] = {}
    others = []
    for name in peft_names:
        match = PEFT_NAME.match(name)
        if match:
            layers.setdefault(int(match.group(1)), set()).add(match.group(2))
        else:
            others.append(MODULE_OF.sub("", name))  # peft also saves an adapted output head's base weight
    if others:
        unsupported = sorted(set(others))
        raise UsageError(
            f"The megatron engine puts LoRA adapters on the text decoder's attention projections (self_attn."
            f"q/k/v/o_proj) only; model.lora.target_modules also adapts {', '.join(unsupported[:5])}"
            f"{f' and {len(unsupported) - 5} more' if len(unsupported) > 5 else ''}.",
            hint="Leave model.lora.target_modules unset (the attention projections), or use train.engine=torch or "
            "fsdp2 for these targets.")
    return {layer: sorted(parts) for layer, parts in sorted(layers.items())}


def megatron_name(layer: int, projection: str, matrix: str) -> str:
    module = "linear_proj" if projection == "o" else "linear_qkv"
    return f"decoder.layers.{layer}.self_attention.{module}.lora_{matrix}.{projection}"


def to_megatron(peft: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft's adapter tensors -> whole megatron-layout adapters (the same tensors, megatron's names)."""
    out = {}
    for name, tensor in peft.items():
        match = PEFT_NAME.match(name)
        assert match, name  # ``adapted`` refused the rest
        out[megatron_name(int(match.group(1)), match.group(2), match.group(3))] = tensor
    return out


def to_peft(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole megatron-layout adapters -> peft's names on the transformers thinker, the inverse of ``to_megatron``."""
    out = {}
    for name, tensor in full.items():
        match = MEGATRON_NAME.match(name)
        assert match, name
        layer, _, matrix, projection = match.groups()
        out[f"model.language_model.layers.{layer}.self_attn.{projection}_proj.lora_{matrix}.weight"] = tensor
    return out


def interleave(deltas: dict[str, torch.Tensor], rows: dict[str, int], groups: int) -> torch.Tensor:
    """The fused ``linear_qkv`` layout of per-projection outputs (..., rows_p): per query group, its q rows, k rows,
    v rows (a projection without an adapter: zeros). ``rows``: each projection's local rows; ``groups``: the local
    query groups."""
    some = next(iter(deltas.values()))
    lead = some.shape[:-1]
    pieces = [(deltas[p] if p in deltas else some.new_zeros(*lead, rows[p])).reshape(*lead, groups, rows[p] // groups)
              for p in QKV]
    return torch.cat(pieces, dim=-1).reshape(*lead, -1)


class _Adapted(torch.nn.Module):
    """A megatron linear layer (``base_layer``, frozen) with LoRA adapters ``lora_A[p]`` (rank, in) and
    ``lora_B[p]`` (out, rank), local shards, for each adapted projection p."""

    def __init__(self, base: torch.nn.Module, shapes: dict[str, tuple[tuple[int, int], tuple[int, int]]],
                 scale: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base_layer = base
        self.scale = scale
        self.enabled = True  # off: the base layer alone (the reference policy, ``disabled``)
        self.lora_A = torch.nn.ParameterDict(
            {p: torch.nn.Parameter(torch.zeros(a, dtype=dtype, device=device)) for p, (a, _) in shapes.items()})
        self.lora_B = torch.nn.ParameterDict(
            {p: torch.nn.Parameter(torch.zeros(b, dtype=dtype, device=device)) for p, (_, b) in shapes.items()})

    def branch(self, a: torch.Tensor, projection: str) -> torch.Tensor:
        return torch.nn.functional.linear(a, self.lora_B[projection]) * self.scale


class LoraQKV(_Adapted):
    """``linear_qkv`` (column parallel) with adapters on some of q, k, v: A whole, B split with the output rows."""

    def __init__(self, base: torch.nn.Module, projections: list[str], rank: int, scale: float, hidden: int,
                 rows: dict[str, int], groups: int, dtype: torch.dtype, device: torch.device):
        super().__init__(base, {p: ((rank, hidden), (rows[p], rank)) for p in projections}, scale, dtype, device)
        self.rows, self.groups = rows, groups

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        out, bias = self.base_layer(x, *args, **kwargs)
        if not self.enabled:
            return out, bias
        x = x.to(next(iter(self.lora_A.values())).dtype)
        deltas = {p: self.branch(copy_to_tensor_model_parallel_region(torch.nn.functional.linear(x, a)), p)
                  for p, a in self.lora_A.items()}
        return (out + interleave(deltas, self.rows, self.groups)).to(out.dtype), bias


class LoraProj(_Adapted):
    """``linear_proj`` (row parallel) with the o adapter: A split with the input columns, B whole."""

    def __init__(self, base: torch.nn.Module, rank: int, scale: float, local_in: int, hidden: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(base, {"o": ((rank, local_in), (hidden, rank))}, scale, dtype, device)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        out, bias = self.base_layer(x, *args, **kwargs)
        if not self.enabled:
            return out, bias
        partial = torch.nn.functional.linear(x.to(self.lora_A["o"].dtype), self.lora_A["o"])
        return (out + self.branch(reduce_from_tensor_model_parallel_region(partial), "o")).to(out.dtype), bias


def add_adapters(gpt: Any, config: Any, layers: dict[int, list[str]], rank: int, alpha: float, tp: int,
                 dtype: torch.dtype, device: torch.device) -> None:
    """Wrap each adapted layer's ``linear_qkv`` / ``linear_proj`` of ``gpt`` (this rank's shards, zeros until
    loaded); every other parameter is frozen."""
    gpt.requires_grad_(False)
    groups = config.num_key_value_heads // tp
    head = config.head_dim
    rows = {"q": config.num_attention_heads // tp * head, "k": groups * head, "v": groups * head}
    scale = alpha / rank
    for layer, projections in layers.items():
        attention = gpt.decoder.layers[layer].self_attention
        qkv = [p for p in projections if p in QKV]
        if qkv:
            attention.linear_qkv = LoraQKV(attention.linear_qkv, qkv, rank, scale, config.hidden_size, rows,
                                           groups, dtype, device)
        if "o" in projections:
            attention.linear_proj = LoraProj(attention.linear_proj, rank, scale, rows["q"], config.hidden_size,
                                             dtype, device)


@contextmanager
def disabled(gpt: torch.nn.Module) -> Iterator[None]:
    """The base model: every adapter of ``gpt`` off (peft's ``disable_adapter``, the LoRA reference policy)."""
    layers = [m for m in gpt.modules() if isinstance(m, _Adapted)]
    for layer in layers:
        layer.enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.enabled = True
