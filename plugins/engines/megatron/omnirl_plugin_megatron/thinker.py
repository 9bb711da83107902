"""The Qwen3-Omni thinker's text decoder as a megatron-core ``GPTModel`` (MoE layers from megatron's own blocks),
and the conversion of its weights between the transformers layout and megatron's tensor / expert-parallel shards.

What maps to what (transformers ``Qwen3OmniMoeThinkerForConditionalGeneration``, prefix ``model.language_model.``):

| transformers | megatron-core (local spec) | split over ranks |
|---|---|---|
| ``embed_tokens.weight`` / ``lm_head.weight`` | ``embedding.word_embeddings`` / ``output_layer`` | vocab rows (TP) |
| ``self_attn.{q,k,v}_proj.weight`` | ``self_attention.linear_qkv`` (fused, per query group: q heads, k, v) | query groups (TP) |
| ``self_attn.o_proj.weight`` | ``self_attention.linear_proj`` | input columns (TP) |
| ``self_attn.{q,k}_norm.weight`` | ``self_attention.{q,k}_layernorm`` (RMSNorm over the head) | replicated |
| ``input_layernorm`` / ``post_attention_layernorm`` / ``norm`` | ``input_layernorm`` / ``pre_mlp_layernorm`` / ``decoder.final_layernorm`` | replicated |
| ``mlp.gate.weight`` (router) | ``mlp.router.weight`` | replicated |
| ``mlp.experts.gate_up_proj[e]`` ([gate; up]) | ``mlp.experts.local_experts.j.linear_fc1`` ([gate; up]) | experts (EP), then each half (expert TP) |
| ``mlp.experts.down_proj[e]`` | ``mlp.experts.local_experts.j.linear_fc2`` | experts (EP), input columns (expert TP) |

The router: softmax over the experts, top-k, renormalised when ``norm_topk_prob`` (megatron: top-k of the logits,
then softmax over them, ``moe_router_pre_softmax=False``: the same distribution); no load-balancing loss (the
policy's forward computes none). Rotary embedding: Qwen3-Omni's multimodal RoPE with equal time / height / width
positions, which text-only prompts have, is the plain RoPE megatron applies. Media (image / audio) prompts are
refused: their positions differ per axis and their features come from the encoders, which stay in transformers.

The conversion is pure tensor code over a ``Layout`` (tensor-parallel and expert-parallel coordinates), so the
same functions shard the loaded weights, gather the trained ones, and re-shard a checkpoint saved on another
number of ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

PREFIX = "model.language_model."
LORA = re.compile(r"\.linear_(qkv|proj)\.lora_([AB])\.[qkvo]$")
EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Layout:
    """Where one rank sits: its tensor-parallel coordinates (attention, embeddings, dense MLPs) and expert ones."""

    tp: int = 1
    tp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0

    def to_json(self) -> dict[str, int]:
        return {"tp": self.tp, "tp_rank": self.tp_rank, "ep": self.ep, "ep_rank": self.ep_rank, "etp": self.etp,
                "etp_rank": self.etp_rank}


def current_layout() -> Layout:
    from megatron.core import parallel_state as ps

    return Layout(tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                  ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
                  etp=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank())


# -- the megatron model ----------------------------------------------------------------------------------------

def text_config(thinker: Any) -> Any:
    return thinker.config.text_config


def check_supported(config: Any) -> None:
    """Refuse what this mapping does not cover (each a silently wrong number otherwise)."""
    from omnirl_core.errors import UsageError

    rope = dict(getattr(config, "rope_parameters", None) or {})
    problems = []
    if config.hidden_act != "silu":
        problems.append(f"hidden_act {config.hidden_act!r} (only SwiGLU, 'silu')")
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type {rope.get('rope_type')!r} (only the default RoPE)")
    if getattr(config, "sliding_window", None):
        problems.append("sliding-window attention")
    if problems:
        raise UsageError("The megatron engine cannot build this Qwen3-Omni thinker: " + "; ".join(problems) + ".",
                         hint="Train it with train.engine=torch or fsdp2.")


def moe_layers(config: Any) -> list[int]:
    """1 for each MoE layer, 0 for a dense one (``mlp_only_layers``, ``decoder_sparse_step``), as transformers."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", []) or [])
    return [int(i not in dense and config.num_experts > 0 and (i + 1) % step == 0)
            for i in range(config.num_hidden_layers)]


def build_gpt(config: Any, dtype: torch.dtype, tp: int, ep: int, recompute: bool = False) -> Any:
    """The text decoder as a megatron ``GPTModel`` on this rank (CPU initialisation; the weights are then loaded
    by ``load_into``). Process groups must exist (``initialize_model_parallel``). ``recompute``: megatron's full
    activation recompute, one layer at a time (the model's ``gradient_checkpointing``)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig

    check_supported(config)
    pattern = moe_layers(config)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    tf = TransformerConfig(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, num_query_groups=config.num_key_value_heads,
        kv_channels=config.head_dim, ffn_hidden_size=config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=config.rms_norm_eps, qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=config.attention_bias,
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        num_moe_experts=config.num_experts if any(pattern) else None,
        moe_ffn_hidden_size=config.moe_intermediate_size if any(pattern) else None,
        moe_layer_freq=pattern, moe_router_topk=config.num_experts_per_tok,
        moe_router_pre_softmax=not config.norm_topk_prob, moe_router_score_function="softmax",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=tp if ep == 1 else 1,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        recompute_granularity="full" if recompute else None, recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
    )
    spec = get_gpt_decoder_block_spec(tf, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(config=tf, transformer_layer_spec=spec, vocab_size=config.vocab_size,
                    max_sequence_length=config.max_position_embeddings, pre_process=True, post_process=True,
                    share_embeddings_and_output_weights=bool(config.tie_word_embeddings),
                    position_embedding_type="rope", rotary_base=float(rope.get("rope_theta", 10000.0)),
                    rotary_percent=1.0, parallel_output=True)


def decoder_hidden(gpt: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Last hidden states (B, S, H) of right-padded ``input_ids`` (B, S): positions 0..S-1 and a causal mask
    (padding sits after a row's tokens, so no real token sees it)."""
    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device).expand(batch, length)
    # True = masked; megatron's own default causal mask is made on CUDA
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=input_ids.device), diagonal=1)
    embedded = gpt.embedding(input_ids=input_ids, position_ids=positions)  # (S, B, H)
    hidden = gpt.decoder(hidden_states=embedded, attention_mask=causal[None, None],
                         rotary_pos_emb=gpt.rotary_pos_emb(length))
    return hidden.transpose(0, 1)


def output_logits(gpt: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits (N, V) of hidden states (N, H): the vocab-parallel head, gathered."""
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    logits, _ = gpt.output_layer(hidden, weight=weight, runtime_gather_output=True)
    return logits


# -- layouts -------------------------------------------------------------------------------------------------

def _split_rule(name: str) -> tuple[str, int]:
    """How a megatron parameter is split over its tensor-parallel group: ('dup', -), ('dim', d) or ('glu', 0)
    (each half of [gate; up] split on its own). LoRA adapters (``lora.py``): ``linear_qkv``'s B with the output
    rows, ``linear_proj``'s A with the input columns, the other matrix whole."""
    adapter = LORA.search(name)
    if adapter:
        split = {("qkv", "B"): 0, ("proj", "A"): 1}.get(adapter.groups())
        return ("dup", 0) if split is None else ("dim", split)
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")):
        return "dim", 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "dim", 1
    if name.endswith("linear_fc1.weight"):
        return "glu", 0
    return "dup", 0


def is_expert(name: str) -> bool:
    return EXPERT.match(name) is not None


def _tp_of(name: str, layout: Layout) -> tuple[int, int]:
    return (layout.etp, layout.etp_rank) if is_expert(name) else (layout.tp, layout.tp_rank)


def _local_experts(num_experts: int, layout: Layout) -> int:
    return num_experts // layout.ep


def shard(full: dict[str, torch.Tensor], layout: Layout, num_experts: int) -> dict[str, torch.Tensor]:
    """Megatron-layout whole tensors (experts by global index) -> this rank's local shards (local indices)."""
    out: dict[str, torch.Tensor] = {}
    per_rank = _local_experts(num_experts, layout)
    for name, tensor in full.items():
        match = EXPERT.match(name)
        if match:
            expert = int(match.group(2))
            if expert // per_rank != layout.ep_rank:
                continue
            name = f"{match.group(1)}{expert % per_rank}{match.group(3)}"
        size, rank = _tp_of(name, layout)
        rule, dim = _split_rule(name)
        if rule == "dup" or size == 1:
            out[name] = tensor
        elif rule == "dim":
            out[name] = tensor.chunk(size, dim=dim)[rank]
        else:
            gate, up = tensor.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    return out


def unshard(pieces: list[tuple[Layout, dict[str, torch.Tensor]]], num_experts: int) -> dict[str, torch.Tensor]:
    """Every rank's local shards (one entry per rank of a layout; data-parallel replicas may repeat) -> whole
    megatron-layout tensors, experts by global index."""
    by_name: dict[str, dict[int, torch.Tensor]] = {}
    for layout, local in pieces:
        per_rank = _local_experts(num_experts, layout)
        for name, tensor in local.items():
            match = EXPERT.match(name)
            if match:
                name = f"{match.group(1)}{layout.ep_rank * per_rank + int(match.group(2))}{match.group(3)}"
            by_name.setdefault(name, {})[_tp_of(name, layout)[1]] = tensor
    full: dict[str, torch.Tensor] = {}
    for name, parts in by_name.items():
        ordered = [parts[r] for r in sorted(parts)]
        rule, dim = _split_rule(name)
        if rule == "dup" or len(ordered) == 1:
            full[name] = ordered[0]
        elif rule == "dim":
            full[name] = torch.cat(ordered, dim=dim)
        else:
            halves = [p.chunk(2, dim=0) for p in ordered]
            full[name] = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return full


# -- transformers <-> megatron ---------------------------------------------------------------------------------

def _layer_maps(i: int) -> list[tuple[str, str]]:
    hf, mg = f"{PREFIX}layers.{i}.", f"decoder.layers.{i}."
    return [(hf + "input_layernorm.weight", mg + "input_layernorm.weight"),
            (hf + "self_attn.q_norm.weight", mg + "self_attention.q_layernorm.weight"),
            (hf + "self_attn.k_norm.weight", mg + "self_attention.k_layernorm.weight"),
            (hf + "self_attn.o_proj.weight", mg + "self_attention.linear_proj.weight"),
            (hf + "post_attention_layernorm.weight", mg + "pre_mlp_layernorm.weight")]


def hf_names(config: Any) -> list[str]:
    """The transformers parameters the megatron model holds (the text decoder and the output head)."""
    names = [f"{PREFIX}embed_tokens.weight", f"{PREFIX}norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i, moe in enumerate(moe_layers(config)):
        hf = f"{PREFIX}layers.{i}."
        names += [h for h, _ in _layer_maps(i)]
        names += [hf + f"self_attn.{p}_proj.weight" for p in "qkv"]
        if config.attention_bias:
            names += [hf + f"self_attn.{p}_proj.bias" for p in "qkv"]
        names += ([hf + "mlp.gate.weight", hf + "mlp.experts.gate_up_proj", hf + "mlp.experts.down_proj"] if moe
                  else [hf + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")])
    return names


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[q; k; v] -> megatron's per-query-group order [q heads of group g, k_g, v_g] for each g."""
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
                     dim=1).reshape(-1, *rest)


def _split_qkv(fused: torch.Tensor, config: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, head = config.num_key_value_heads, config.head_dim
    per_group = config.num_attention_heads // groups * head
    rest = fused.shape[1:]
    q, k, v = fused.reshape(groups, per_group + 2 * head, *rest).split([per_group, head, head], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def to_megatron(hf: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """transformers tensors (``hf_names``) -> whole megatron-layout tensors, experts by global index."""
    out = {"embedding.word_embeddings.weight": hf[f"{PREFIX}embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf[f"{PREFIX}norm.weight"]}
    if not config.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i, moe in enumerate(moe_layers(config)):
        hf_p, mg = f"{PREFIX}layers.{i}.", f"decoder.layers.{i}."
        out.update({m: hf[h] for h, m in _layer_maps(i)})
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            q, k, v = (hf[f"{hf_p}self_attn.{p}_proj.{kind}"] for p in "qkv")
            out[f"{mg}self_attention.linear_qkv.{kind}"] = _fuse_qkv(q, k, v, config.num_key_value_heads)
        if moe:
            out[mg + "mlp.router.weight"] = hf[hf_p + "mlp.gate.weight"]
            for e, (fc1, fc2) in enumerate(zip(hf[hf_p + "mlp.experts.gate_up_proj"],
                                               hf[hf_p + "mlp.experts.down_proj"])):
                out[f"{mg}mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1
                out[f"{mg}mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2
        else:
            out[mg + "mlp.linear_fc1.weight"] = torch.cat([hf[hf_p + "mlp.gate_proj.weight"],
                                                           hf[hf_p + "mlp.up_proj.weight"]])
            out[mg + "mlp.linear_fc2.weight"] = hf[hf_p + "mlp.down_proj.weight"]
    return out


def layer_of(name: str) -> int | None:
    """The decoder layer a megatron parameter belongs to; None: the embedding, final norm or output head."""
    match = LAYER.match(name)
    return int(match.group(1)) if match else None


def to_hf(full: dict[str, torch.Tensor], config: Any, layers: list[int] | None = None,
          outside: bool = True) -> dict[str, torch.Tensor]:
    """Whole megatron-layout tensors -> transformers tensors (``hf_names``), the inverse of ``to_megatron``; only the
    decoder ``layers`` given (None: all) and, with ``outside``, the embedding, final norm and head (a part at a
    time: the export converts one layer's gathered tensors at a time)."""
    out: dict[str, torch.Tensor] = {}
    if outside:
        out[f"{PREFIX}embed_tokens.weight"] = full["embedding.word_embeddings.weight"]
        out[f"{PREFIX}norm.weight"] = full["decoder.final_layernorm.weight"]
        if not config.tie_word_embeddings:
            out["lm_head.weight"] = full["output_layer.weight"]
    for i, moe in enumerate(moe_layers(config)):
        if layers is not None and i not in layers:
            continue
        hf_p, mg = f"{PREFIX}layers.{i}.", f"decoder.layers.{i}."
        out.update({h: full[m] for h, m in _layer_maps(i)})
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            for p, t in zip("qkv", _split_qkv(full[f"{mg}self_attention.linear_qkv.{kind}"], config)):
                out[f"{hf_p}self_attn.{p}_proj.{kind}"] = t
        if moe:
            out[hf_p + "mlp.gate.weight"] = full[mg + "mlp.router.weight"]
            experts = range(config.num_experts)
            out[hf_p + "mlp.experts.gate_up_proj"] = torch.stack(
                [full[f"{mg}mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in experts])
            out[hf_p + "mlp.experts.down_proj"] = torch.stack(
                [full[f"{mg}mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in experts])
        else:
            gate, up = full[mg + "mlp.linear_fc1.weight"].chunk(2)
            out[hf_p + "mlp.gate_proj.weight"], out[hf_p + "mlp.up_proj.weight"] = gate, up
            out[hf_p + "mlp.down_proj.weight"] = full[mg + "mlp.linear_fc2.weight"]
    return out
