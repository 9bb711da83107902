"""The tokenizer helpers for tiny presets (``omnirl_core.presets``): the real Qwen vocabulary with Qwen3's specials
at their released ids and the Qwen chat template; the CLIP and T5 style tokenizers' layouts."""

from __future__ import annotations

from omnirl_core.presets import QWEN3_SPECIALS, clip_tokenizer, qwen3_tokenizer, t5_tokenizer


def test_qwen3_tokenizer_has_the_released_special_ids_and_chat_markup():
    tok = qwen3_tokenizer()
    # released Qwen3 ids: <|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645, <think> 151667, </think> 151668
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]) == \
        [151643, 151644, 151645, 151667, 151668]
    assert tok.convert_tokens_to_ids(QWEN3_SPECIALS[0]) == 151657
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    quiet = tok.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert quiet.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    media = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
    assert "<|vision_start|><|image_pad|><|vision_end|>what?" in tok.apply_chat_template(media, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 151644 and tok.decode(ids) == text  # special tokens are single ids, and decoding round-trips


def test_qwen3_tokenizer_appends_extra_specials_after_qwen3s():
    tok = qwen3_tokenizer(extra_specials=["<|audio_start|>"], name="qwen3-test-extra")
    assert tok.convert_tokens_to_ids("<|audio_start|>") == 151669


def test_clip_and_t5_tokenizers_frame_their_sequences(capfd):
    clip = clip_tokenizer()
    ids = clip("a red square")["input_ids"]
    assert ids[0] == clip.bos_token_id and ids[-1] == clip.eos_token_id
    t5 = t5_tokenizer()
    assert t5("a red square")["input_ids"][-1] == t5.eos_token_id
    out, err = capfd.readouterr()
    assert out.strip() == "" and err.strip() == ""  # training the BPE prints no progress bar
