"""Qwen3-Omni thinker on the tiny preset: from_pretrained round trip with the real Qwen tokenizer, prompts with
images and audio, rollout through transformers generate, and rollout/trainer token log-prob agreement."""

from __future__ import annotations

import json
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from omnirl_plugin_qwen3_omni.media import audio_token_count, load_audio
from omnirl_plugin_qwen3_omni.model import Qwen3OmniOptions, create_model, load_thinker
from omnirl_plugin_qwen3_omni.tiny import save_tiny
from PIL import Image

from omnirl_core.ar.policy_gradient import AR_PLAN
from omnirl_core.ar.sampling import SamplingParams
from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.contracts import GenRequest
from omnirl_core.errors import UsageError
from omnirl_core.testing import ar_rollout, check_ar_logprob_consistency, check_ar_model, run_train


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("qwen3-omni-tiny"), seed=3)


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (48, 80, 3), dtype=np.uint8)).save(root / "noise.png")
    with wave.open(str(root / "tone.wav"), "wb") as wav:  # 0.7 s at 8 kHz, 16-bit: resampled to 16 kHz
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(8000)
        t = np.arange(5600) / 8000
        wav.writeframes((np.sin(2 * np.pi * 440 * t) * 12000).astype(np.int16).tobytes())
    return {"image": str(root / "noise.png"), "audio": str(root / "tone.wav")}


def _model(tiny_dir: Path):
    model = create_model(ModelSection(name="qwen3-omni", preset="tiny", path=str(tiny_dir)), Qwen3OmniOptions(), "cpu")
    model.setup_training(LoraConfig(rank=4, alpha=8), need_reference=False)
    return model


@pytest.fixture(scope="module")
def shared_model(tiny_dir: Path):
    """One LoRA model for the tests that leave its weights alone."""
    return _model(tiny_dir)


def _requests(prompts: list[tuple[str, dict]], group_size: int = 2) -> list[GenRequest]:
    out = []
    for p, (text, inputs) in enumerate(prompts):
        for g in range(group_size):
            uid = p * group_size + g
            out.append(GenRequest(uid=uid, prompt=text, prompt_index=p, group=p, seed=1000 + uid, height=0, width=0,
                                  plan=AR_PLAN, inputs=inputs))
    return out


def test_tiny_preset_has_the_released_token_ids_and_reloads(tiny_dir: Path):
    thinker, tok, media_encoder = load_thinker(str(tiny_dir), torch.float32, "sdpa")
    assert type(thinker).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|audio_start|>",
                                     "<|audio_pad|>"])
    assert ids == [151643, 151645, 151655, 151669, 151675]  # as in Qwen3-Omni's released config
    assert thinker.config.audio_token_id == 151675 and thinker.config.image_token_id == 151655
    assert tok.encode("Hello world") == [9707, 1879]  # the real Qwen byte-level BPE ranks
    assert media_encoder.image_processor is not None and media_encoder.feature_extractor is not None
    again, _, _ = load_thinker(str(tiny_dir), torch.float32, "sdpa")
    for (name, a), (_, b) in zip(thinker.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_full_omni_checkpoint_layout_loads_the_thinker(tiny_dir: Path, tmp_path: Path):
    """Released checkpoints are the whole omni model (model_type qwen3_omni_moe, weights under 'thinker.')."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    thinker, tok, _ = load_thinker(str(tiny_dir), torch.float32, "sdpa")
    full = Qwen3OmniMoeForConditionalGeneration(
        Qwen3OmniMoeConfig(thinker_config=thinker.config.to_dict(), enable_audio_output=False))
    full.thinker.load_state_dict(thinker.state_dict())
    full.save_pretrained(str(tmp_path), safe_serialization=True)
    tok.save_pretrained(str(tmp_path))
    (tmp_path / "preprocessor_config.json").write_text((tiny_dir / "preprocessor_config.json").read_text())
    loaded, _, _ = load_thinker(str(tmp_path), torch.float32, "sdpa")
    assert type(loaded).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    torch.testing.assert_close(loaded.lm_head.weight, thinker.lm_head.weight)


def test_missing_checkpoints_are_clear_errors(tmp_path: Path, monkeypatch):
    with pytest.raises(UsageError, match="no config.json"):
        load_thinker(str(tmp_path), torch.float32, "sdpa")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: patch the value
    with pytest.raises(UsageError, match="hub is unreachable") as err:
        load_thinker("Qwen/Qwen3-Omni-30B-A3B-Instruct", torch.float32, "sdpa")
    assert "--preset tiny" in err.value.hint


def test_lora_adapts_only_the_text_decoder_attention(shared_model):
    model = shared_model
    names = [n for n, p in model.module.named_parameters() if p.requires_grad]
    assert names and all(".language_model.layers." in n and ".self_attn." in n and "lora_" in n for n in names)
    assert len(names) == 2 * 4 * 2  # 2 layers x (q, k, v, o) x (A, B)


def test_prompt_placeholders_match_the_encoders(shared_model, media: dict[str, str]):
    model = shared_model
    [request] = _requests([("What is this?", {"image": media["image"], "audio": media["audio"]})], group_size=1)
    prompt = model.encode_prompt(request)
    ids = prompt.input_ids
    n_image = int((ids == model.image_token_id).sum())
    n_audio = int((ids == model.audio_token_id).sum())
    with torch.no_grad():
        audio = model.module.get_audio_features(prompt.media["input_features"], prompt.media["feature_attention_mask"])
    # 0.7 s = 70 mel frames (hop 10 ms) -> 35 -> 18 -> 9 after the encoder's three stride-2 convolutions
    assert n_audio == audio.last_hidden_state.shape[0] == int(audio_token_count(torch.tensor(70), 50)) == 9
    assert int(audio_token_count(torch.tensor(250), 50)) == 2 * 13 + 7  # two full 100-frame chunks + 50
    grid = prompt.media["image_grid_thw"][0]
    assert n_image == int(grid.prod()) // 4 > 0
    assert len(load_audio(media["audio"])) == 11200  # 0.7 s resampled to 16 kHz
    text = model.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")
    assert text.endswith("What is this?<|im_end|>\n<|im_start|>assistant\n")


PROMPTS = [
    ("Which letter? A or B.", {}),
    ("A much longer question, so that the batch needs left padding: which of the letters comes first?", {}),
]


def _params(model, max_new_tokens: int = 6, allowed_tokens: tuple[str, ...] = (), **sampling) -> SamplingParams:
    stop = model.stop_token_ids
    allowed = tuple(dict.fromkeys([model.token_id(t) for t in allowed_tokens] + list(stop))) if allowed_tokens else None
    return SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop, allowed_token_ids=allowed, **sampling)


@pytest.mark.parametrize("sampling", [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 50, "top_p": 0.9},
    {"temperature": 1.3, "allowed_tokens": ("A", "B", "C")},
])
def test_trainer_rescoring_equals_rollout_logprobs(shared_model, media: dict[str, str], sampling: dict):
    """With unchanged weights the trainer's log-prob of every sampled token equals the rollout's to 1e-5,
    whatever the sampling processors, for text, image and audio prompts re-scored in mixed batches."""
    model = shared_model
    prompts = PROMPTS + [("Describe the picture.", {"image": media["image"]}),
                         ("What do you hear?", {"audio": media["audio"]})]
    samples = check_ar_logprob_consistency(model, _requests(prompts), _params(model, **sampling))
    assert len(samples) == 8
    if "allowed_tokens" in sampling:
        allowed = {model.token_id(t) for t in "ABC"} | set(model.stop_token_ids)
        assert all(set(s.completion.tolist()) <= allowed for s in samples)


def test_lora_weights_save_in_the_peft_layout_and_reload(tiny_dir: Path, tmp_path: Path):
    from peft import PeftConfig

    model = _model(tiny_dir)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    samples = ar_rollout(model, _requests(PROMPTS[:1]), _params(model, max_new_tokens=4))
    files = model.save_trained(tmp_path)
    assert files == ["adapter_model.safetensors", "adapter_config.json"]
    assert PeftConfig.from_pretrained(str(tmp_path)).r == 4
    # peft itself reads the adapter onto a freshly loaded thinker: same logits as the trained model
    from peft import PeftModel

    base, _, _ = load_thinker(str(tiny_dir), torch.float32, "sdpa")
    ids = samples[0].prompt_tokens.input_ids[None]
    with torch.no_grad():
        torch.testing.assert_close(PeftModel.from_pretrained(base, str(tmp_path))(input_ids=ids).logits,
                                   model.module(input_ids=ids).logits)
    fresh = _model(tiny_dir)
    fresh.load_trained(tmp_path)
    args = ([s.prompt_tokens for s in samples], [s.completion for s in samples],
            [s.sampling for s in samples])
    with torch.no_grad():
        for a, b in zip(model.token_logprobs(*args), fresh.token_logprobs(*args)):
            torch.testing.assert_close(a, b)
        with fresh.reference():  # the adapter off: the base model
            base = fresh.token_logprobs(*args)
        trained = fresh.token_logprobs(*args)
    assert max(float((a - b).abs().max()) for a, b in zip(base, trained)) > 1e-4


def test_video_prompts_are_refused_clearly(shared_model):
    model = shared_model
    [request] = _requests([("What happens?", {"video": "clip.mp4"})], group_size=1)
    with pytest.raises(UsageError, match="Video prompts are not supported"):
        model.encode_prompt(request)


def test_importing_the_plugin_is_cheap():
    code = "import sys, omnirl_plugin_qwen3_omni; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_trains_the_tiny_preset(tmp_path: Path):
    """The real CLI end to end: rollout, answer-match reward, update, checkpoint, text samples."""
    run = tmp_path / "run"
    records = run_train(run, "--model", "qwen3-omni", "--algo", "gspo", "--preset", "tiny", "--steps", "2",
                        "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["logprob/abs_delta_max"] < 1e-5
    sample = json.loads((run / "samples" / "step-000001.jsonl").read_text().splitlines()[0])
    assert set(sample) == {"prompt", "output", "reward"} and sample["reward"] in (0.0, 1.0)
    assert (run / "checkpoints" / "step-000002" / "adapter_model.safetensors").is_file()


def test_ar_contract(shared_model, media: dict[str, str]):
    check_ar_model(shared_model, _requests([("Hi", {}), ("Look:", {"image": media["image"]}),
                                            ("Listen:", {"audio": media["audio"]})], group_size=1))


def test_full_fine_tuning_keeps_the_encoders_frozen_and_round_trips(tiny_dir: Path, tmp_path: Path):
    model = create_model(ModelSection(name="qwen3-omni", preset="tiny", path=str(tiny_dir)), Qwen3OmniOptions(), "cpu")
    model.setup_training(LoraConfig(enabled=False), need_reference=True)
    trained = {n for n, p in model.module.named_parameters() if p.requires_grad}
    assert "lm_head.weight" in trained and not any(".audio_tower." in n or ".visual." in n for n in trained)
    with torch.no_grad():
        model.module.lm_head.weight.add_(0.1)
    assert model.save_trained(tmp_path) == ["model/"]
    fresh = create_model(ModelSection(name="qwen3-omni", preset="tiny", path=str(tiny_dir)), Qwen3OmniOptions(), "cpu")
    fresh.setup_training(LoraConfig(enabled=False), need_reference=False)
    fresh.load_trained(tmp_path)
    torch.testing.assert_close(fresh.module.lm_head.weight, model.module.lm_head.weight)
    with model.reference():  # the frozen copy made before training
        assert not torch.equal(model.module.lm_head.weight, fresh.module.lm_head.weight)
