"""Qwen-Image plugin on the tiny preset: real from_pretrained round trip, LoRA into a diffusers pipeline,
and rollout/trainer log-prob consistency."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omnirl_plugin_qwen_image.model import QwenImageOptions, create_model, load_pipeline
from omnirl_plugin_qwen_image.tiny import save_tiny

from omnirl_core.config import LoraConfig, ModelSection, RunConfig
from omnirl_core.errors import UsageError
from omnirl_core.flow.policy_gradient import FlowPolicyGradient
from omnirl_core.interfaces import GenRequest, RolloutPlan


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("qwen-image-tiny"), seed=3)


def test_tiny_preset_saves_and_reloads_through_from_pretrained(tiny_dir: Path):
    assert (tiny_dir / "model_index.json").is_file()
    assert list((tiny_dir / "transformer").glob("*.safetensors"))
    assert (tiny_dir / "tokenizer" / "tokenizer.json").is_file()
    pipe = load_pipeline(str(tiny_dir), torch.float32)
    assert type(pipe).__name__ == "QwenImagePipeline"
    assert len(pipe.tokenizer) >= 151657  # the real Qwen2 vocabulary
    # the real template prefix is exactly the 34 tokens the pipeline drops
    template = pipe.prompt_template_encode.format("")
    assert len(pipe.tokenizer(template).input_ids) - 5 == pipe.prompt_template_encode_start_idx
    out1 = pipe(prompt="a red square", height=32, width=32, num_inference_steps=2, output_type="pt",
                generator=torch.Generator().manual_seed(0)).images
    again = load_pipeline(str(tiny_dir), torch.float32)
    out2 = again(prompt="a red square", height=32, width=32, num_inference_steps=2, output_type="pt",
                 generator=torch.Generator().manual_seed(0)).images
    torch.testing.assert_close(out1, out2)


def test_not_a_model_directory_is_a_clear_error(tmp_path: Path):
    with pytest.raises(UsageError, match="no model_index.json"):
        load_pipeline(str(tmp_path), torch.float32)


def _model(tiny_dir: Path, lora: bool = True):
    model = create_model(ModelSection(name="qwen-image", preset="tiny", path=str(tiny_dir)), QwenImageOptions(), "cpu")
    model.setup_training(LoraConfig(enabled=lora, rank=4, alpha=4), need_reference=True)
    return model


def _rollout(model, guidance: float, steps: int = 4):
    from omnirl_plugin_diffusers.engine import DiffusersRolloutEngine

    plan = RolloutPlan(step_kinds=("sde",) * (steps - 1) + ("ode",), train_steps=tuple(range(steps - 1)), eta=0.9)
    requests = [
        GenRequest(uid=i, prompt=p, prompt_index=i // 2, group=i // 2, seed=100 + i, height=32, width=32,
                   plan=plan, guidance_scale=guidance, noise_seed=100 + i)
        for i, p in enumerate(["a red square", "a red square", "a blue square, photo", "a blue square, photo"])
    ]
    return list(DiffusersRolloutEngine(model, None, "cpu").generate(requests))


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_trainer_reevaluation_equals_rollout_logprob(tiny_dir: Path, guidance: float):
    """With unchanged weights the trainer's log-prob of every stored transition equals the rollout's
    (fp32, CPU) to 1e-5: the first PPO ratio is 1."""
    model = _model(tiny_dir)
    samples = _rollout(model, guidance)
    config = RunConfig()
    config.rollout.num_steps = 4
    algo = FlowPolicyGradient(type("O", (), {"beta": 0.0, "global_std": True, "adv_clip": 5.0,
                                             "clip_range": 1e-4})(), config)
    units = algo.training_units(samples)
    assert len(units) == 4 * 3
    # micro-batches that mix prompts, samples and steps differently from the rollout's batches
    units = units[::2] + units[1::2]
    with torch.no_grad():
        for start in range(0, len(units), 5):
            metrics = algo.prepare(model, units[start:start + 5])
            assert metrics["logprob/abs_delta_max"] <= 1e-5, metrics
    old = torch.stack([u.old_logprob for u in units])
    rollout = torch.stack([u.rollout_logprob for u in units])
    assert torch.isfinite(rollout).all()
    assert (old - rollout).abs().max().item() <= 1e-5
    for u in units:
        u.sample.advantage = 1.0
    _, metrics = algo.loss(model, units[:6], first_update=True)
    assert metrics["ratio/mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["clip_frac"] == 0.0


def test_lora_checkpoint_loads_into_a_diffusers_pipeline_and_changes_its_output(tiny_dir: Path, tmp_path: Path):
    model = _model(tiny_dir)
    with torch.no_grad():  # stand-in for training: move the LoRA weights away from their zero init
        g = torch.Generator().manual_seed(0)
        for p in model.trainable_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    files = model.save_trained(tmp_path / "ckpt")
    assert files == ["pytorch_lora_weights.safetensors"]

    def render(pipe):
        return pipe(prompt="a red square", height=32, width=32, num_inference_steps=3, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).images

    pipe = load_pipeline(str(tiny_dir), torch.float32)
    before = render(pipe)
    pipe.load_lora_weights(str(tmp_path / "ckpt"))
    after = render(pipe)
    assert (after - before).abs().max().item() > 1e-3
    # and the same LoRA reproduces the trained model's own velocity
    from peft.utils import get_peft_model_state_dict

    adapter = next(iter(pipe.transformer.peft_config))
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=adapter)
    trained = model.trained_state_dict()
    assert set(loaded) and len(loaded) == len(trained)
    for key, value in trained.items():
        assert key in loaded, key
        torch.testing.assert_close(loaded[key], value)


def test_full_finetune_reference_is_a_frozen_copy(tiny_dir: Path):
    model = _model(tiny_dir, lora=False)
    x = torch.randn(1, 4, 8, 8)
    sigma = torch.tensor([0.5])
    cond = model.encode(["a red square"])
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(0.05)
        trained = model.velocity(x, sigma, cond)
        with model.reference():
            ref = model.velocity(x, sigma, cond)
    assert (trained - ref).abs().max() > 1e-3
    assert not any(p.requires_grad for p in model._reference_copy.parameters())


def test_unreachable_hub_id_is_a_clear_error():
    import os
    import subprocess
    import sys

    code = ("import torch\nfrom omnirl_plugin_qwen_image.model import load_pipeline\n"
            "from omnirl_core.errors import UsageError\n"
            "try:\n    load_pipeline('Qwen/Qwen-Image', torch.float32)\nexcept UsageError as e:\n"
            "    print('ERR', e.render())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=False)
    assert "ERR Could not load Qwen-Image from 'Qwen/Qwen-Image'" in out.stdout, out.stderr[-2000:]
    assert "--preset tiny" in out.stdout


def test_flow_model_contract(tiny_dir: Path):
    from omnirl_core.testing import check_flow_model

    check_flow_model(_model(tiny_dir), height=32, width=32)


def test_encode_reads_hidden_states_without_projecting_every_token(tiny_dir: Path):
    """The LM head (152k-word vocabulary) sees one position per prompt, and the embeddings equal the
    pipeline's own encoding (which projects every token)."""
    model = _model(tiny_dir)
    prompts = ["a red square on a white background", "text"]
    positions = []
    handle = model.pipeline.text_encoder.lm_head.register_forward_hook(
        lambda module, args, out: positions.append(args[0].shape[1]))
    try:
        cond = model.encode(prompts)
        with torch.no_grad():
            embeds, mask = model.pipeline._get_qwen_prompt_embeds(prompts, device="cpu", dtype=torch.float32)
    finally:
        handle.remove()
    assert positions[0] == 1 and positions[1] > 30  # ours, then the pipeline's unpatched call
    assert "forward" not in vars(model.pipeline.text_encoder)  # the patch is gone after the call
    torch.testing.assert_close(cond.tensors["prompt_embeds"], embeds[:, :cond.tensors["prompt_embeds"].shape[1]])
    assert torch.equal(cond.tensors["prompt_mask"], mask[:, :cond.tensors["prompt_mask"].shape[1]].long())
