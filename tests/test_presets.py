"""The preset cache's tokenizers: their configs list the added tokens as released checkpoints do, and a tokenizer
loads the same with the list as without it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from omnirl_core.presets import atomic_directory, list_added_tokens, qwen3_tokenizer

TEXT = "<|im_start|>user\nA red cat, 42 apples.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nB<|im_end|>"


def test_a_tokenizer_loads_the_same_with_its_added_tokens_listed(tmp_path: Path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("OMNIRL_CACHE", str(tmp_path / "cache"))
    saved = tmp_path / "as-transformers-saves-it"
    qwen3_tokenizer().save_pretrained(str(saved))
    config = json.loads((saved / "tokenizer_config.json").read_text())
    assert "added_tokens_decoder" not in config  # what transformers 5 writes for a fast tokenizer

    listed = tmp_path / "listed"
    shutil.copytree(saved, listed)
    list_added_tokens(listed)
    config = json.loads((listed / "tokenizer_config.json").read_text())
    full = json.loads((listed / "tokenizer.json").read_text())
    assert sorted(int(i) for i in config["added_tokens_decoder"]) == sorted(t["id"] for t in full["added_tokens"])
    assert config["added_tokens_decoder"]["151645"]["content"] == "<|im_end|>"

    plain, fast = AutoTokenizer.from_pretrained(str(saved)), AutoTokenizer.from_pretrained(str(listed))
    assert plain.added_tokens_decoder == fast.added_tokens_decoder
    assert plain.all_special_tokens == fast.all_special_tokens
    assert (plain.eos_token_id, plain.pad_token_id) == (fast.eos_token_id, fast.pad_token_id)
    ids = plain.encode(TEXT, add_special_tokens=False)
    assert ids == fast.encode(TEXT, add_special_tokens=False)
    assert 151645 in ids and len(ids) > 20
    assert plain.decode(ids, skip_special_tokens=True) == fast.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "hi"}]
    assert plain.apply_chat_template(messages, tokenize=False) == fast.apply_chat_template(messages, tokenize=False)


def test_the_preset_cache_lists_the_added_tokens_of_what_it_builds(tmp_path: Path):
    def build(directory: Path) -> None:
        (directory / "tokenizer").mkdir()
        (directory / "tokenizer" / "tokenizer_config.json").write_text('{"eos_token": "<e>"}')
        (directory / "tokenizer" / "tokenizer.json").write_text(json.dumps(
            {"added_tokens": [{"id": 7, "content": "<e>", "special": True, "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False}]}))
        (directory / "other_config.json").write_text("{}")

    out = atomic_directory(tmp_path / "preset", build)
    config = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())
    assert config == {"eos_token": "<e>", "added_tokens_decoder": {"7": {
        "content": "<e>", "special": True, "single_word": False, "lstrip": False, "rstrip": False,
        "normalized": False}}}
    assert (out / "other_config.json").read_text() == "{}"
