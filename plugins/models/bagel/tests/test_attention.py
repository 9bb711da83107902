"""BAGEL's attention rules, checked against independent computations: the vectorised split mask against a
per-pair reading of the rules, the layer's packed-sequence attention against dense eager attention with that
explicit mask, packing several samples into one sequence against running each alone, the KV-cached prompt
against the single pass, and the MoT routing."""

from __future__ import annotations

import random

import pytest
import torch
from omnirl_plugin_bagel.config import BagelConfig, LLMConfig
from omnirl_plugin_bagel.transformer import (
    CAUSAL,
    FULL,
    NOISE,
    BagelTransformer,
    MoTAttention,
    SplitLayout,
    rope_cos_sin,
    split_attention_mask,
    text_to_image_layout,
)

LLM = LLMConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, vocab_size=300)


def _rule(sample, split, kind, q: int, k: int) -> bool:
    """The rules in words, one pair at a time: same sample; an earlier split unless it is a noisy image; the
    same split entirely (full, noise) or up to the query (causal). A padding query sees itself only."""
    if sample[q] < 0:
        return q == k
    if sample[k] != sample[q]:
        return False
    if split[k] < split[q]:
        return kind[k] != NOISE
    if split[k] == split[q]:
        return kind[q] != CAUSAL or k <= q
    return False


def _random_packing(rng: random.Random, samples: int, pad: int):
    sample, split, kind = [], [], []
    for s in range(samples):
        for i in range(rng.randint(1, 4)):
            k = rng.choice([CAUSAL, FULL, NOISE])
            n = rng.randint(1, 4)
            sample += [s] * n
            split += [i] * n
            kind += [k] * n
    sample += [-1] * pad
    split += [0] * pad
    kind += [CAUSAL] * pad
    return torch.tensor(sample), torch.tensor(split), torch.tensor(kind)


@pytest.mark.parametrize("seed", range(6))
def test_split_mask_equals_the_rules_pair_by_pair(seed: int):
    rng = random.Random(seed)
    sample, split, kind = _random_packing(rng, samples=rng.randint(1, 3), pad=rng.randint(0, 3))
    mask = split_attention_mask(sample, split, kind)
    s = sample.shape[0]
    expected = torch.tensor([[_rule(sample.tolist(), split.tolist(), kind.tolist(), q, k) for k in range(s)]
                             for q in range(s)])
    assert torch.equal(mask, expected)


def test_text_to_image_layout_reads_as_the_rules_say():
    mask_text = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    layout = text_to_image_layout(mask_text, num_latents=2)
    m = layout.mask()
    # row 0: 3 text tokens then [soi, x, x, eoi] at position 3
    assert layout.position[0].tolist() == [0, 1, 2, 3, 3, 3, 3]
    assert layout.position[1].tolist()[3:] == [1] * 4 and layout.position[2].tolist()[3:] == [0] * 4
    assert layout.gen[0].tolist() == [False] * 4 + [True, True, False]
    assert m[0, :3, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert not m[0, :3, 3:].any()  # text never sees the image
    assert m[0, 3:].all()  # the block sees all text and itself in full
    assert m[1, 3:, 0].all() and not m[1, 3:, 1:3].any()  # padding is never a key
    assert not m[2, 3:, :3].any() and m[2, 3:, 3:].all()  # empty (text-dropped) context


def _eager_attention(q, k, v, allowed):
    """softmax(q k^T / sqrt(d) + log mask) v, GQA by repeating keys, in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def test_packed_attention_equals_dense_attention_with_the_explicit_mask():
    torch.manual_seed(0)
    attn = MoTAttention(LLM).double()
    rng = random.Random(1)
    sample, split, kind = _random_packing(rng, samples=3, pad=2)
    s = sample.shape[0]
    gen = (kind == NOISE)[None]
    x = torch.randn(1, s, LLM.hidden_size, dtype=torch.float64)
    position = torch.arange(s)[None]
    cos, sin = rope_cos_sin(position, LLM.head_dim, LLM.rope_theta)
    allowed = torch.tensor([[_rule(sample.tolist(), split.tolist(), kind.tolist(), q, k) for k in range(s)]
                            for q in range(s)])[None]
    out, (k, _v) = attn(x, gen, cos.double(), sin.double(), split_attention_mask(sample, split, kind)[None])

    # the same projections by hand, then eager attention with the explicit mask
    def proj(name, heads, norm=None):
        rows = []
        for i in range(s):
            sfx = "_moe_gen" if gen[0, i] else ""
            y = getattr(attn, name + sfx)(x[0, i]).view(heads, LLM.head_dim)
            rows.append(getattr(attn, norm + sfx)(y) if norm else y)
        return torch.stack(rows)[None]

    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    q_ref, k_ref = apply_rotary_pos_emb(proj("q_proj", 4, "q_norm"), proj("k_proj", 2, "k_norm"), cos.double(),
                                        sin.double(), unsqueeze_dim=2)
    v_ref = proj("v_proj", 2)
    torch.testing.assert_close(k, k_ref, rtol=0, atol=1e-10)
    o = _eager_attention(q_ref, k_ref, v_ref, allowed).reshape(1, s, -1)
    ref = torch.stack([(attn.o_proj_moe_gen if gen[0, i] else attn.o_proj)(o[0, i]) for i in range(s)])[None]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert (out - ref).abs().max().item() <= 1e-5


def _tiny_transformer(seed: int = 0) -> BagelTransformer:
    torch.manual_seed(seed)
    return BagelTransformer(BagelConfig(llm=LLM, max_latent_size=4)).eval()


def test_kv_cached_prompt_equals_the_single_pass():
    net = _tiny_transformer()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0], [0, 0, 0, 0]])
    text_mask = (torch.arange(4)[None] < torch.tensor([[4], [2], [0]])).long()
    latents = torch.randn(3, 6, 64)
    t = torch.tensor([1.0, 0.6, 0.3])
    with torch.no_grad():
        single = net(latents, t, 2, 3, ids, text_mask, 1, 2)
        cached = net(latents, t, 2, 3, ids, text_mask, 1, 2, prompt_kv=net.prompt_kv(ids, text_mask))
    torch.testing.assert_close(cached, single, rtol=0, atol=1e-5)


def test_a_sample_does_not_depend_on_the_padding_or_the_rows_beside_it():
    net = _tiny_transformer()
    ids = torch.tensor([[5, 6, 7, 8, 11], [9, 10, 0, 0, 0]])
    text_mask = (ids != 0).long()
    latents = torch.randn(2, 4, 64)
    t = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        both = net(latents, t, 2, 2, ids, text_mask, 1, 2)
        alone = net(latents[1:], t[1:], 2, 2, ids[1:, :2], text_mask[1:, :2], 1, 2)
    torch.testing.assert_close(both[1:], alone, rtol=0, atol=1e-5)


def test_packing_two_samples_in_one_sequence_equals_running_them_apart():
    """Two text-to-image samples packed into one row (sample ids keep them apart) give each sample's own result."""
    net = _tiny_transformer()
    model = net.language_model.model
    lens, n = (3, 2), 4
    rows = []
    for length in lens:
        ids = torch.arange(5, 5 + length)[None]
        block = net.block_embeddings(torch.randn(1, n, 64), torch.tensor([0.5]), 2, 2, 1, 2)
        rows.append((ids, torch.cat([model.embed_tokens(ids), block], dim=1)))
    with torch.no_grad():
        apart = []
        for ids, seq in rows:
            layout = text_to_image_layout(torch.ones_like(ids), n)
            apart.append(net._run_layers(seq, layout, layout.mask())[0])
        parts = [text_to_image_layout(torch.ones_like(ids), n) for ids, _ in rows]
        packed = SplitLayout(*(torch.cat([getattr(p, f) + (i if f == "sample" else 0) for i, p in enumerate(parts)],
                                         dim=1) for f in ("sample", "split", "kind", "position", "gen")))
        out = net._run_layers(torch.cat([seq for _, seq in rows], dim=1), packed, packed.mask())[0]
    torch.testing.assert_close(out, torch.cat(apart, dim=1), rtol=0, atol=1e-5)


def test_mot_routing_text_never_reads_the_generation_expert():
    net = _tiny_transformer()
    ids = torch.tensor([[5, 6, 7]])
    mask = torch.ones_like(ids)
    latents, t = torch.randn(1, 4, 64), torch.tensor([0.5])
    with torch.no_grad():
        kv, v = net.prompt_kv(ids, mask), net(latents, t, 2, 2, ids, mask, 1, 2)
        for name, p in net.named_parameters():
            if "_moe_gen" in name:
                p.add_(0.1)
        torch.testing.assert_close(net.prompt_kv(ids, mask), kv, rtol=0, atol=0)
        assert (net(latents, t, 2, 2, ids, mask, 1, 2) - v).abs().max() > 1e-3
    # gradients: the generation expert's attention only from latent tokens; the markers use the und expert
    net.zero_grad()
    net(latents, t, 2, 2, ids, mask, 1, 2).sum().backward()
    layer = net.layers[0]
    assert layer.self_attn.q_proj_moe_gen.weight.grad.abs().sum() > 0
    assert layer.self_attn.q_proj.weight.grad.abs().sum() > 0  # soi/eoi queries, through the und expert
