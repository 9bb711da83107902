"""BAGEL plugin on its tiny preset: the released layout saved and loaded back (forced fields applied, unused
parts reported, clear errors), the flow-model contract, BAGEL's schedule, tokens and CFG, rollout/trainer
log-prob agreement with CFG on, LoRA and full fine-tuning round trips, and the prompt KV cache."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omnirl_plugin_bagel.model import BagelOptions, create_model, patchify, unpatchify
from omnirl_plugin_bagel.tiny import save_tiny

from omnirl_core.config import LoraConfig, ModelSection, RunConfig
from omnirl_core.contracts import Conditioning, GenRequest, RolloutPlan, Sample
from omnirl_core.errors import UsageError
from omnirl_core.flow.policy_gradient import FlowPolicyGradient
from omnirl_core.flow.sampler import sample_step

SIZE = 64


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("bagel-tiny"), seed=3)


@pytest.fixture(scope="module")
def shared(tiny_dir: Path):
    """One loaded model (LoRA r4, adapters still zero: the base numbers) for the tests that only read it."""
    return _model(tiny_dir)


def _model(path: Path, lora: bool = True, **options):
    model = create_model(ModelSection(name="bagel", preset="tiny", path=str(path)), BagelOptions(**options), "cpu")
    model.setup_training(LoraConfig(enabled=lora, rank=4, alpha=4), need_reference=True)
    return model


def _perturb(params, scale: float = 0.3, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=g))


def _probe(model, guidance: float = 1.0):
    x = torch.randn(2, *model.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(1))
    cond = Conditioning.cat([model.encode(["a red square"]), model.encode(["a blue car on a street"])])
    uncond = Conditioning.cat([model.encode([""])] * 2)
    with torch.no_grad():
        return model.velocity(x, torch.tensor([1.0, 0.55]), cond, guidance, uncond)


# -- the released layout ---------------------------------------------------------------------------------------
def test_tiny_preset_is_saved_in_the_released_layout_and_loads_back(tiny_dir: Path, shared):
    from safetensors import safe_open

    for name in ("config.json", "llm_config.json", "vit_config.json", "ema.safetensors", "ae.safetensors",
                 "tokenizer.json"):
        assert (tiny_dir / name).is_file(), name
    llm = json.loads((tiny_dir / "llm_config.json").read_text())
    assert "qk_norm" not in llm and "layer_module" not in llm  # as released: the loader must force them
    with safe_open(str(tiny_dir / "ema.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"language_model.model.layers.0.self_attn.q_norm_moe_gen.weight", "language_model.lm_head.weight",
            "latent_pos_embed.pos_embed", "time_embedder.mlp.2.weight", "llm2vae.bias",
            "vit_model.vision_model.embeddings.patch_embedding.weight", "connector.fc2.weight"} <= keys
    with safe_open(str(tiny_dir / "ae.safetensors"), "pt") as f:
        assert {"encoder.down.0.block.0.conv1.weight", "decoder.mid.attn_1.q.weight", "decoder.up.1.upsample.conv.weight"} <= set(f.keys())

    model = _model(tiny_dir, lora=False)
    cfg = model.config.llm
    assert (cfg.qk_norm, cfg.tie_word_embeddings, cfg.layer_module) == (True, False, "Qwen2MoTDecoderLayer")
    report = model.load_report
    assert report.forced["qk_norm"] == (None, True) and report.forced["layer_module"][1] == "Qwen2MoTDecoderLayer"
    assert report.not_used["LM head (text output)"] == 1 and report.not_used["SigLIP understanding tower"] > 10
    assert model.special_ids == {"<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
                                 "<|vision_end|>": 151653}
    # the loaded network holds exactly the checkpoint's tensors
    with safe_open(str(tiny_dir / "ema.safetensors"), "pt") as f:
        for key, value in model.denoiser.state_dict().items():
            assert torch.equal(value, f.get_tensor(key)), key
    torch.testing.assert_close(_probe(shared), _probe(model), rtol=0, atol=0)


def test_a_stale_max_latent_size_is_taken_from_the_position_table(tiny_dir: Path, tmp_path: Path):
    copy = tmp_path / "stale"
    shutil.copytree(tiny_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config["max_latent_size"] = 32  # what some released files say, over a smaller (here) or larger table
    (copy / "config.json").write_text(json.dumps(config))
    model = _model(copy)
    assert model.config.max_latent_size == 8 and model.load_report.forced["max_latent_size"] == (32, 8)
    assert model.latent_shape(128, 64) == (16, 16, 8)  # position ids use the table's row stride
    with pytest.raises(UsageError, match="at most 128x128"):
        model.latent_shape(144, 64)


def test_sharded_weights_and_a_saved_copy_load_the_same(tiny_dir: Path, tmp_path: Path, shared):
    from safetensors.torch import load_file, save_file

    shards = tmp_path / "sharded"
    shutil.copytree(tiny_dir, shards)
    state = load_file(str(shards / "ema.safetensors"))
    (shards / "ema.safetensors").unlink()
    keys = sorted(state)
    weight_map = {}
    for i, part in enumerate((keys[::2], keys[1::2])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(shards / name))
        weight_map.update(dict.fromkeys(part, name))
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    torch.testing.assert_close(_probe(_model(shards)), _probe(shared), rtol=0, atol=0)


def test_bad_directories_are_clear_errors(tiny_dir: Path, tmp_path: Path):
    with pytest.raises(UsageError, match="no config.json"):
        _model(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    (broken / "ema.safetensors").unlink()
    with pytest.raises(UsageError, match="No BAGEL weights") as err:
        _model(broken)
    assert "--set model.path=DIR" in err.value.render()
    shutil.copy(tiny_dir / "ema.safetensors", broken / "ema.safetensors")
    llm = json.loads((broken / "llm_config.json").read_text())
    llm["num_hidden_layers"] = 3
    (broken / "llm_config.json").write_text(json.dumps(llm))
    with pytest.raises(UsageError, match="lacks 28 tensors"):
        _model(broken)
    llm["num_hidden_layers"], llm["intermediate_size"] = 2, 80
    (broken / "llm_config.json").write_text(json.dumps(llm))
    with pytest.raises(UsageError, match="does not match its configuration"):
        _model(broken)
    (broken / "ae.safetensors").unlink()
    shutil.copy(tiny_dir / "llm_config.json", broken / "llm_config.json")
    with pytest.raises(UsageError, match="no ae.safetensors"):
        _model(broken)


# -- the contract and BAGEL's own rules ----------------------------------------------------------------------------
def test_flow_model_contract(shared):
    from omnirl_core.testing import check_flow_model

    check_flow_model(shared, height=SIZE, width=SIZE)


def test_schedule_is_bagels_shifted_linspace(shared):
    model = shared
    u = torch.linspace(1, 0, 6, dtype=torch.float64)
    expected = (3 * u / (1 + 2 * u)).float()
    assert torch.equal(model.sigmas(5, (16, 8, 8)), expected)
    assert model.sigmas(5, (16, 8, 8))[0] == 1.0


def test_latent_tokens_are_2x2_patches_in_p_q_c_order():
    x = torch.arange(2 * 16 * 4 * 6, dtype=torch.float32).view(2, 16, 4, 6)
    tokens = patchify(x)
    assert tokens.shape == (2, 6, 64)
    # token (row 1, col 2) = pixels (2..3, 4..5); channel index = (p * 2 + q) * 16 + c
    for p in range(2):
        for q in range(2):
            for c in (0, 15):
                assert tokens[1, 1 * 3 + 2, (p * 2 + q) * 16 + c] == x[1, c, 2 + p, 4 + q]
    assert torch.equal(unpatchify(tokens, 2, 3), x)


def test_cfg_is_bagels_text_cfg_with_renorm(shared, monkeypatch):
    model = shared
    g = torch.Generator().manual_seed(0)
    v_c, v_u = torch.randn(3, 5, 64, generator=g), torch.randn(3, 5, 64, generator=g)
    sigma = torch.tensor([1.0, 0.5, 0.2])
    out = model.guide(v_c, v_u, 4.0, sigma)
    raw = v_u + 4.0 * (v_c - v_u)
    factor = (v_c.norm(dim=(1, 2)) / (raw.norm(dim=(1, 2)) + 1e-8)).clamp(0, 1)
    torch.testing.assert_close(out, raw * factor[:, None, None])
    assert (out.norm(dim=(1, 2)) <= v_c.norm(dim=(1, 2)) + 1e-5).all()  # never scaled up
    torch.testing.assert_close(model.guide(v_c, v_u, 1.0, sigma), v_c)
    monkeypatch.setattr(model, "options", model.options.model_copy())  # the shared model's options stay as they are
    model.options.cfg_interval = (0.4, 1.0)
    model.options.cfg_renorm = "none"
    out = model.guide(v_c, v_u, 4.0, sigma)
    torch.testing.assert_close(out[:2], raw[:2])
    torch.testing.assert_close(out[2], v_c[2])  # t = 0.2 is outside (0.4, 1]
    model.options.cfg_renorm = "channel"
    out = model.guide(v_c, v_u, 4.0, sigma)
    per_token = (v_c.norm(dim=2) / (raw.norm(dim=2) + 1e-8)).clamp(0, 1)
    torch.testing.assert_close(out[:2], (raw * per_token[..., None])[:2])


def test_train_cfg_grad_both_differentiates_the_unconditional_branch(tiny_dir: Path):
    from omnirl_core.flow.model import cfg_gradient

    model = _model(tiny_dir)
    _perturb([p for p in model.denoiser.parameters() if p.requires_grad], scale=0.05)  # LoRA B away from zero
    x = torch.randn(2, *model.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(1))
    cond = Conditioning.cat([model.encode(["a red square"]), model.encode(["a blue car on a street"])])
    uncond = Conditioning.cat([model.encode([""])] * 2)
    s = torch.tensor([0.9, 0.55])
    trained = [p for p in model.denoiser.parameters() if p.requires_grad]
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))

    def grads(mode: str | None) -> list[torch.Tensor]:
        for p in trained:
            p.grad = None
        if mode is None:  # written out: BAGEL's guide over both branches, both differentiated
            p_ = model.config.latent_patch_size
            h, w = x.shape[-2] // p_, x.shape[-1] // p_
            from omnirl_plugin_bagel.model import patchify, unpatchify

            tokens = patchify(x.to(model.device, model.dtype), p_)
            v = unpatchify(model.guide(model._branch(tokens, s, cond, h, w), model._branch(tokens, s, uncond, h, w),
                                       4.0, s), h, w, p_)
        else:
            with cfg_gradient(mode):
                v = model.velocity(x, s, cond, 4.0, uncond)
        (v * probe).sum().backward()  # not |v|^2: the renormalised velocity's norm is the conditional one's
        return [p.grad.clone() for p in trained]

    exact, both, detached = grads(None), grads("both"), grads("cond")
    for e, b in zip(exact, both):
        assert (e - b).abs().max() <= 1e-4 * (e.abs().max() + 1e-12)
    assert max(((d - e).abs().max() / (e.abs().max() + 1e-12)).item() for d, e in zip(detached, exact)) > 1e-2


def test_blank_prompt_is_the_text_dropped_context(shared):
    model = shared
    blank = model.encode([" "]).tensors
    assert blank["text_mask"].shape == (1, 1) and blank["text_mask"].sum() == 0  # one padding slot, no token
    ids = model.encode(["a red square"]).tensors["input_ids"][0].tolist()
    assert ids[0] == 151644 and ids[-1] == 151645 and len(ids) == 2 + len(model.tokenizer.encode("a red square"))


def test_prompt_kv_cache_gives_the_single_pass_numbers(tiny_dir: Path, shared):
    cached = shared
    assert "prompt_kv" in cached.encode(["a"]).tensors
    plain = _model(tiny_dir, prompt_kv_cache=False)
    assert "prompt_kv" not in plain.encode(["a"]).tensors
    torch.testing.assert_close(_probe(cached, 4.0), _probe(plain, 4.0), rtol=0, atol=1e-5)


def test_training_the_understanding_expert_turns_the_prompt_cache_off(tiny_dir: Path, shared):
    model = _model(tiny_dir, train_expert="und")
    names = [n for n, p in model.denoiser.named_parameters() if p.requires_grad]
    assert names and not any("_moe_gen" in n for n in names) and model.text_trainable
    assert "prompt_kv" not in model.encode(["a"]).tensors
    gen = shared
    assert all("_moe_gen" in n for n, p in gen.denoiser.named_parameters() if p.requires_grad)
    assert not gen.text_trainable


# -- rollout vs trainer --------------------------------------------------------------------------------------------
def _rollout(model, guidance: float, steps: int = 4) -> list[Sample]:
    """The rollout side, written here with the core sampler: all samples in one batch per step, each with its
    own noise and per-prompt conditioning (as a rollout engine holds it)."""
    plan = RolloutPlan(step_kinds=("sde",) * (steps - 1) + ("ode",), train_steps=tuple(range(steps - 1)), eta=0.9)
    prompts = ["a red square", "a red square", "a blue square, photo", "a blue square, photo"]
    requests = [GenRequest(uid=i, prompt=p, prompt_index=i // 2, group=i // 2, seed=100 + i, height=SIZE,
                           width=SIZE, plan=plan, guidance_scale=guidance) for i, p in enumerate(prompts)]
    conds = [model.encode([p]) for p in prompts]
    uncond = model.encode([""]) if guidance > 1.0 else None
    shape = model.latent_shape(SIZE, SIZE)
    sigmas = model.sigmas(steps, shape)
    x = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(r.seed)) for r in requests])
    noise = [torch.Generator().manual_seed(r.seed + 1) for r in requests]
    states, logprobs = [x], torch.full((4, steps), float("nan"))
    batch_cond = Conditioning.cat(conds)
    batch_uncond = Conditioning.cat([uncond] * 4) if uncond is not None else None
    with torch.no_grad():
        for i in range(steps):
            s, s_next = sigmas[i].expand(4), sigmas[i + 1].expand(4)
            v = model.velocity(x, s, batch_cond, guidance, batch_uncond)
            kind = plan.step_kinds[i]
            eps = None if kind == "ode" else torch.stack([torch.randn(shape, generator=g) for g in noise])
            out = sample_step(kind, x, v, s, s_next, plan.eta, eps, sigmas[1].expand(4))
            if out.logprob is not None:
                logprobs[:, i] = out.logprob
            x = out.prev_sample
            states.append(x)
    traj = torch.stack(states, dim=1)
    return [Sample(request=r, latents=traj[k], sigmas=sigmas, logprobs=logprobs[k], output=None,
                   cond=conds[k], uncond=uncond) for k, r in enumerate(requests)]


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_trainer_reevaluation_equals_rollout_logprob(tiny_dir: Path, guidance: float):
    """With unchanged weights the trainer's log-prob of every stored transition equals the rollout's (fp32, CPU)
    to 1e-5, CFG on or off: the first PPO ratio is 1."""
    model = _model(tiny_dir)
    _perturb(model.trainable_parameters(), 0.05)  # a non-zero adapter, so that LoRA is in the path
    samples = _rollout(model, guidance)
    config = RunConfig()
    config.rollout.num_steps = 4
    algo = FlowPolicyGradient(type("O", (), {"beta": 0.0, "global_std": True, "adv_clip": 5.0,
                                             "clip_range": 1e-4})(), config)
    units = algo.training_units(samples)
    assert len(units) == 4 * 3
    units = units[::2] + units[1::2]  # micro-batches that mix prompts and steps unlike the rollout's batches
    with torch.no_grad():
        for start in range(0, len(units), 5):
            metrics = algo.prepare(model, units[start:start + 5])
            assert metrics["logprob/abs_delta_max"] <= 1e-5, metrics
    old = torch.stack([u.old_logprob for u in units])
    rollout = torch.stack([u.rollout_logprob for u in units])
    assert torch.isfinite(rollout).all() and (old - rollout).abs().max().item() <= 1e-5
    for u in units:
        u.sample.advantage = 1.0
    loss, metrics = algo.loss(model, units[:6], first_update=True)
    assert metrics["ratio/mean"] == pytest.approx(1.0, abs=1e-5) and metrics["clip_frac"] == 0.0
    loss.backward()
    assert all(p.grad is not None for p in model.trainable_parameters())


# -- trained weights -----------------------------------------------------------------------------------------------
def test_lora_checkpoint_is_peft_layout_and_round_trips(tiny_dir: Path, tmp_path: Path, shared):
    from omnirl_plugin_bagel.checkpoint import load_transformer
    from peft import PeftModel

    model = _model(tiny_dir)
    assert all(".self_attn." in n or ".mlp_moe_gen." in n for n in model.trained_state_dict())
    _perturb(model.trainable_parameters())
    trained = _probe(model, 4.0)
    assert model.save_trained(tmp_path / "ckpt") == ["adapter_model.safetensors", "adapter_config.json"]
    # peft reads it onto a freshly loaded transformer
    base, _, _ = load_transformer(tiny_dir, torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "ckpt"))
    fresh = _model(tiny_dir)
    fresh.denoiser = peft_model.base_model.model
    torch.testing.assert_close(_probe(fresh, 4.0), trained, rtol=0, atol=1e-6)
    # and resume reads it back
    again = _model(tiny_dir)
    assert (_probe(again, 4.0) - trained).abs().max() > 1e-3
    again.load_trained(tmp_path / "ckpt")
    torch.testing.assert_close(_probe(again, 4.0), trained, rtol=0, atol=0)
    with again.reference():
        torch.testing.assert_close(_probe(again, 4.0), _probe(shared, 4.0), rtol=0, atol=1e-6)


def test_full_finetune_saves_the_released_layout(tiny_dir: Path, tmp_path: Path):
    model = _model(tiny_dir, lora=False)
    trainable = [n for n, p in model.denoiser.named_parameters() if p.requires_grad]
    assert trainable and all("_moe_gen" in n for n in trainable)
    _perturb(model.trainable_parameters(), 0.05)
    trained = _probe(model)
    with model.reference():
        assert (_probe(model) - trained).abs().max() > 1e-3
    assert model.save_trained(tmp_path / "ckpt") == ["model/"]
    saved = tmp_path / "ckpt" / "model"
    assert {"config.json", "llm_config.json", "ema.safetensors"} <= {p.name for p in saved.iterdir()}
    # the saved directory plus the autoencoder and tokenizer is a loadable BAGEL checkpoint
    for f in tiny_dir.iterdir():
        if f.name.startswith(("ae.", "tokenizer")):
            shutil.copy(f, saved / f.name)
    loaded = create_model(ModelSection(name="bagel", preset="tiny", path=str(saved)), BagelOptions(), "cpu")
    torch.testing.assert_close(_probe(loaded), trained, rtol=0, atol=0)
    resumed = _model(tiny_dir, lora=False)
    resumed.load_trained(tmp_path / "ckpt")
    torch.testing.assert_close(_probe(resumed), trained, rtol=0, atol=0)


def test_encode_images_inverts_decode_shape_and_is_deterministic(shared):
    model = shared
    images = torch.rand(2, 3, SIZE, SIZE)
    z = model.encode_images(images)
    assert z.shape == (2, *model.latent_shape(SIZE, SIZE)) and z.dtype == torch.float32
    torch.testing.assert_close(model.encode_images(images), z)
    assert model.decode(z).shape == images.shape


def test_importing_the_plugin_is_cheap():
    code = "import sys, omnirl_plugin_bagel; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
