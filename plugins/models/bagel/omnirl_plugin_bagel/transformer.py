"""BAGEL's generation network in plain PyTorch: the Qwen2.5 language model with Mixture-of-Transformers (MoT)
layers, and the generation heads around it. Written from the BAGEL paper (arXiv:2505.14683) and the notes in
the omnirl repository; module and parameter names follow the released checkpoint, so that ``state_dict()``
keys are those of ``ema.safetensors``.

MoT: every layer holds two full sets of weights, the understanding expert (Qwen's own names) and the
generation expert (the same names + ``_moe_gen``). Routing is by token type, with no learned router: VAE
latent tokens go through the generation expert, every text token (the ``<|vision_start|>`` /
``<|vision_end|>`` markers around an image included) through the understanding expert. The attention itself is
one softmax over all tokens of both experts.

Attention rules of a packed sequence (a sequence of splits, each ``causal``, ``full`` or ``noise``): a token
sees the earlier splits of its own sample, except ``noise`` splits (nobody outside a noisy image attends to
it); within its split it sees everything (``full``, ``noise``) or the tokens up to itself (``causal``).
Text-to-image is [text: causal] [<|vision_start|>, latents, <|vision_end|>: noise], the whole image block at
one RoPE position, the one after the text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

from omnirl_plugin_bagel.config import BagelConfig, LLMConfig

CAUSAL, FULL, NOISE = 0, 1, 2
SPLIT_KINDS = {"causal": CAUSAL, "full": FULL, "noise": NOISE}


# -- attention rules ---------------------------------------------------------------------------------------------
def split_attention_mask(sample: torch.Tensor, split: torch.Tensor, kind: torch.Tensor) -> torch.Tensor:
    """Which key each query may attend to, for packed sequences: ``sample``, ``split``, ``kind`` (..., S) give
    every position's sample (-1: padding), split number (increasing within a sample) and split kind. Returns a
    bool (..., S, S) mask, True = attend. A padding position attends to itself only (no row is empty)."""
    s_q, s_k = sample[..., :, None], sample[..., None, :]
    p_q, p_k = split[..., :, None], split[..., None, :]
    index = torch.arange(sample.shape[-1], device=sample.device)
    same_sample = (s_q == s_k) & (s_k >= 0)
    earlier = (p_k < p_q) & (kind[..., None, :] != NOISE)
    within = (p_k == p_q) & ((kind[..., :, None] != CAUSAL) | (index[None, :] <= index[:, None]))
    allowed = same_sample & (earlier | within)
    padding_self = (s_q < 0) & (index[None, :] == index[:, None])
    return allowed | padding_self


@dataclass
class SplitLayout:
    """Per-position tensors of a batch of packed sequences (B, S): sample, split and split kind, RoPE position,
    and which positions go through the generation expert."""

    sample: torch.Tensor
    split: torch.Tensor
    kind: torch.Tensor
    position: torch.Tensor
    gen: torch.Tensor

    def mask(self) -> torch.Tensor:
        return split_attention_mask(self.sample, self.split, self.kind)


def text_to_image_layout(text_mask: torch.Tensor, num_latents: int) -> SplitLayout:
    """Rows of [text (padded to the batch's longest prompt), <|vision_start|>, latents, <|vision_end|>]: text
    causal at positions 0..L-1, the image block one ``noise`` split at position L (L: the row's prompt length;
    0 for an empty, text-dropped context)."""
    b, width = text_mask.shape
    device = text_mask.device
    block = num_latents + 2
    lengths = text_mask.sum(dim=1)
    text_sample = torch.where(text_mask.bool(), 0, -1)
    sample = torch.cat([text_sample, torch.zeros(b, block, dtype=torch.long, device=device)], dim=1)
    split = torch.cat([torch.zeros(b, width, dtype=torch.long, device=device),
                       torch.ones(b, block, dtype=torch.long, device=device)], dim=1)
    kind = torch.cat([torch.full((b, width), CAUSAL, device=device), torch.full((b, block), NOISE, device=device)],
                     dim=1)
    position = torch.cat([torch.arange(width, device=device).expand(b, width), lengths[:, None].expand(b, block)],
                         dim=1)
    gen = torch.zeros(b, width + block, dtype=torch.bool, device=device)
    gen[:, width + 1:width + 1 + num_latents] = True
    return SplitLayout(sample, split, kind, position, gen)


# -- building blocks -----------------------------------------------------------------------------------------------
def rope_cos_sin(position: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain 1D RoPE (rotate-half layout), fp32: cos, sin of shape (B, S, head_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position.device, dtype=torch.float32) / head_dim))
    angles = position.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def routed(x: torch.Tensor, gen: torch.Tensor, und_fn: Callable, gen_fn: Callable) -> torch.Tensor:
    """Apply ``und_fn`` to the rows of ``x`` (N, ...) where ``gen`` (N,) is False and ``gen_fn`` where True."""
    und_idx, gen_idx = (~gen).nonzero()[:, 0], gen.nonzero()[:, 0]
    a, b = und_fn(x.index_select(0, und_idx)), gen_fn(x.index_select(0, gen_idx))
    out = a.new_zeros((x.shape[0], *a.shape[1:]))
    return out.index_copy(0, und_idx, a).index_copy(0, gen_idx, b.to(a.dtype))


class SwiGLU(nn.Module):
    """Qwen2.5's MLP: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoTAttention(nn.Module):
    """Q/K/V (biased) and O projections and per-head QK RMSNorm, once per expert; one attention over all."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        for suffix in ("", "_moe_gen"):
            setattr(self, f"q_proj{suffix}", nn.Linear(d, self.num_heads * hd, bias=True))
            setattr(self, f"k_proj{suffix}", nn.Linear(d, self.num_kv_heads * hd, bias=True))
            setattr(self, f"v_proj{suffix}", nn.Linear(d, self.num_kv_heads * hd, bias=True))
            setattr(self, f"o_proj{suffix}", nn.Linear(self.num_heads * hd, d, bias=False))
            setattr(self, f"q_norm{suffix}", Qwen2RMSNorm(hd, eps=cfg.rms_norm_eps))
            setattr(self, f"k_norm{suffix}", Qwen2RMSNorm(hd, eps=cfg.rms_norm_eps))

    def forward(self, x: torch.Tensor, gen: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``x`` (B, S, D) normed hidden states, ``gen`` (B, S) routing, ``cos``/``sin`` (B, S, hd), ``mask``
        (B, S, P + S) over [past keys, own keys], ``past``: (B, P, kv heads, hd) keys and values of a cached
        context (post-RoPE). Returns the output (B, S, D) and this call's own keys and values (post-RoPE)."""
        b, s, d = x.shape
        flat, route = x.reshape(b * s, d), gen.reshape(b * s)

        def project(name: str, heads: int) -> torch.Tensor:
            out = routed(flat, route, getattr(self, name), getattr(self, f"{name}_moe_gen"))
            return out.view(b * s, heads, self.head_dim)

        q, k, v = project("q_proj", self.num_heads), project("k_proj", self.num_kv_heads), project("v_proj",
                                                                                                    self.num_kv_heads)
        # QK-norm and RoPE in fp32 (as BAGEL does), then back to the weights' dtype for the attention
        q = routed(q.float(), route, self.q_norm, self.q_norm_moe_gen).view(b, s, self.num_heads, self.head_dim)
        k = routed(k.float(), route, self.k_norm, self.k_norm_moe_gen).view(b, s, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary_pos_emb(q.float(), k.float(), cos, sin, unsqueeze_dim=2)
        q, k, v = q.to(x.dtype), k.to(x.dtype), v.view(b, s, self.num_kv_heads, self.head_dim)
        own = (k, v)
        if past is not None:
            k, v = torch.cat([past[0].to(x.dtype), k], dim=1), torch.cat([past[1].to(x.dtype), v], dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask[:, None], enable_gqa=True)
        out = out.transpose(1, 2).reshape(b * s, self.num_heads * self.head_dim)
        return routed(out, route, self.o_proj, self.o_proj_moe_gen).view(b, s, d), own


class MoTDecoderLayer(nn.Module):
    """One Qwen2 decoder layer with both experts (BAGEL's ``Qwen2MoTDecoderLayer``)."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        d = cfg.hidden_size
        self.self_attn = MoTAttention(cfg)
        self.mlp = SwiGLU(d, cfg.intermediate_size)
        self.mlp_moe_gen = SwiGLU(d, cfg.intermediate_size)
        self.input_layernorm = Qwen2RMSNorm(d, eps=cfg.rms_norm_eps)
        self.input_layernorm_moe_gen = Qwen2RMSNorm(d, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen2RMSNorm(d, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm_moe_gen = Qwen2RMSNorm(d, eps=cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, gen: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, s, d = h.shape
        route = gen.reshape(b * s)
        normed = routed(h.reshape(b * s, d), route, self.input_layernorm, self.input_layernorm_moe_gen)
        attn, kv = self.self_attn(normed.view(b, s, d), gen, cos, sin, mask, past)
        h = h + attn
        normed = routed(h.reshape(b * s, d), route, self.post_attention_layernorm,
                        self.post_attention_layernorm_moe_gen)
        h = h + routed(normed, route, self.mlp, self.mlp_moe_gen).view(b, s, d)
        return h, kv


class MoTQwen2Model(nn.Module):
    """``language_model.model``: token embeddings, the MoT layers and one final norm per expert."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([MoTDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = Qwen2RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm_moe_gen = Qwen2RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class LanguageModel(nn.Module):
    """``language_model``: holds ``model`` only. The LM head (text output) is not built: text-to-image never
    reads it, and the loader reports it as not used."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.model = MoTQwen2Model(cfg)


class TimestepEmbedder(nn.Module):
    """The flow time t in [0, 1] (not x1000) -> a 256-d sinusoid, cos half first, frequencies
    exp(-ln(10000) k / 128) (DiT's embedding, arXiv:2212.09748), then Linear -> SiLU -> Linear."""

    frequency_dim = 256

    def __init__(self, hidden: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(self.frequency_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequency_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = t.to(torch.float32)[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


def sincos_2d_table(dim: int, side: int) -> torch.Tensor:
    """The frozen 2D sin-cos position table (side^2, dim): row r * side + c; channels [0, dim/2) encode the
    column c and [dim/2, dim) the row r, each half sin then cos, frequencies 1 / 10000^(i / (dim / 4))."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    coords = torch.arange(side, dtype=torch.float64)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")

    def encode(values: torch.Tensor) -> torch.Tensor:
        angles = values.reshape(-1, 1) * omega[None]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([encode(cols), encode(rows)], dim=1).to(torch.float32)


class LatentPositionEmbedding(nn.Module):
    """``latent_pos_embed``: a frozen table stored in the checkpoint (``pos_embed``), max_latent_size^2 rows."""

    def __init__(self, max_latent_size: int, hidden: int):
        super().__init__()
        self.max_latent_size = max_latent_size
        self.pos_embed = nn.Parameter(sincos_2d_table(hidden, max_latent_size), requires_grad=False)

    def position_ids(self, h: int, w: int, device: torch.device) -> torch.Tensor:
        """Row-major ids of an h x w token grid, on the table's grid (row stride max_latent_size)."""
        rows = torch.arange(h, device=device)[:, None] * self.max_latent_size
        return (rows + torch.arange(w, device=device)[None]).reshape(-1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.pos_embed.index_select(0, ids)


class BagelTransformer(nn.Module):
    """The trained network of BAGEL's generation path: ``language_model`` plus ``time_embedder``,
    ``vae2llm``, ``llm2vae`` and ``latent_pos_embed``. The SigLIP understanding tower, its connector and
    position table, and the LM head are not built (text-to-image reads none of them)."""

    fsdp_forward_methods = ("prompt_kv",)
    """Entry points other than ``forward`` that read the parameters (a sharding engine gathers them there too)."""

    def __init__(self, config: BagelConfig):
        super().__init__()
        self.config = config
        llm = config.llm
        self.language_model = LanguageModel(llm)
        self.time_embedder = TimestepEmbedder(llm.hidden_size)
        self.vae2llm = nn.Linear(config.patch_latent_dim, llm.hidden_size)
        self.llm2vae = nn.Linear(llm.hidden_size, config.patch_latent_dim)
        self.latent_pos_embed = LatentPositionEmbedding(config.max_latent_size, llm.hidden_size)
        self.gradient_checkpointing = False

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.model.layers

    def _run_layers(self, h: torch.Tensor, layout: SplitLayout, mask: torch.Tensor,
                    past: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
                    keep_kv: bool = False) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        llm = self.config.llm
        cos, sin = rope_cos_sin(layout.position, llm.head_dim, llm.rope_theta)
        kvs = []
        for i, layer in enumerate(self.layers):
            layer_past = None if past is None else past[i]
            if self.gradient_checkpointing and torch.is_grad_enabled():
                h, kv = torch.utils.checkpoint.checkpoint(layer, h, layout.gen, cos, sin, mask, layer_past,
                                                          use_reentrant=False)
            else:
                h, kv = layer(h, layout.gen, cos, sin, mask, layer_past)
            if keep_kv:
                kvs.append(kv)
        return h, kvs

    def prompt_kv(self, input_ids: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        """The context's keys and values (post-RoPE) in every layer: (B, L, layers, 2, kv heads, head dim), zero
        at padding. Text only attends to earlier text, so these do not depend on the image block after it."""
        b, width = input_ids.shape
        embeds = self.language_model.model.embed_tokens(input_ids)
        layout = SplitLayout(
            sample=torch.where(text_mask.bool(), 0, -1), split=torch.zeros_like(input_ids),
            kind=torch.full_like(input_ids, CAUSAL), position=torch.arange(width, device=input_ids.device).expand(b, -1),
            gen=torch.zeros(b, width, dtype=torch.bool, device=input_ids.device),
        )
        _, kvs = self._run_layers(embeds, layout, layout.mask(), keep_kv=True)
        kv = torch.stack([torch.stack([k, v], dim=2) for k, v in kvs], dim=2)
        return kv * text_mask[:, :, None, None, None, None].to(kv.dtype)

    def block_embeddings(self, latents: torch.Tensor, t: torch.Tensor, h: int, w: int, soi: int, eoi: int
                         ) -> torch.Tensor:
        """[<|vision_start|>, latent tokens, <|vision_end|>] embeddings: a latent token is vae2llm(x_t) +
        time_embedder(t) + latent_pos_embed(its position); the markers are text tokens."""
        b = latents.shape[0]
        ids = self.latent_pos_embed.position_ids(h, w, latents.device)
        x = self.vae2llm(latents) + self.time_embedder(t)[:, None] + self.latent_pos_embed(ids)[None].to(latents.dtype)
        markers = self.language_model.model.embed_tokens(torch.tensor([soi, eoi], device=latents.device))
        return torch.cat([markers[0].expand(b, 1, -1), x, markers[1].expand(b, 1, -1)], dim=1)

    def forward(self, latents: torch.Tensor, t: torch.Tensor, h: int, w: int, input_ids: torch.Tensor,
                text_mask: torch.Tensor, soi: int, eoi: int, prompt_kv: torch.Tensor | None = None) -> torch.Tensor:
        """The velocity of latent tokens ``latents`` (B, h*w, patch_latent_dim) at flow time ``t`` (B,), given a
        text context (``input_ids``/``text_mask`` (B, L), L may be 0). With ``prompt_kv`` (``prompt_kv``'s
        output) only the image block runs through the layers, attending to the cached context; without it the
        whole sequence runs in one pass. Both follow the same attention rules and give the same numbers."""
        model = self.language_model.model
        block = self.block_embeddings(latents.to(self.vae2llm.weight.dtype), t, h, w, soi, eoi)
        n = h * w
        layout = text_to_image_layout(text_mask, n)
        width = text_mask.shape[1]
        if prompt_kv is not None:
            mask = layout.mask()[:, width:, :]
            block_layout = SplitLayout(*(getattr(layout, f)[:, width:] for f in ("sample", "split", "kind", "position",
                                                                               "gen")))
            past = [(prompt_kv[:, :, i, 0], prompt_kv[:, :, i, 1]) for i in range(len(self.layers))]
            out, _ = self._run_layers(block, block_layout, mask, past)
        else:
            seq = torch.cat([model.embed_tokens(input_ids), block], dim=1)
            out, _ = self._run_layers(seq, layout, layout.mask())
            out = out[:, width:]
        return self.llm2vae(model.norm_moe_gen(out[:, 1:1 + n])).float()
