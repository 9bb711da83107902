"""Qwen-Image plugin on the tiny preset: real from_pretrained round trip, LoRA into a diffusers pipeline,
and rollout/trainer log-prob consistency."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omnirl_plugin_qwen_image.model import QwenImageOptions, create_model, load_pipeline
from omnirl_plugin_qwen_image.tiny import save_tiny

from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.errors import UsageError
from omnirl_core.testing import (
    check_flow_model,
    check_logprob_consistency,
    check_lora_roundtrip,
    check_unreachable_hub_id,
)


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


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_trainer_reevaluation_equals_rollout_logprob(tiny_dir: Path, guidance: float):
    """With unchanged weights the trainer's log-prob of every stored transition equals the rollout's
    (fp32, CPU) to 1e-5: the first PPO ratio is 1."""
    check_logprob_consistency(_model(tiny_dir), 32, 32, guidance_scale=guidance, eta=0.9)


def test_lora_checkpoint_loads_into_a_diffusers_pipeline_and_changes_its_output(tiny_dir: Path, tmp_path: Path):
    def render(pipe):
        return pipe(prompt="a red square", height=32, width=32, num_inference_steps=3, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).images

    check_lora_roundtrip(_model(tiny_dir), tmp_path / "ckpt", lambda: load_pipeline(str(tiny_dir), torch.float32),
                         render)


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
    check_unreachable_hub_id("omnirl_plugin_qwen_image.model:load_pipeline", "Qwen/Qwen-Image", "Qwen-Image")


def test_flow_model_contract(tiny_dir: Path):
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
