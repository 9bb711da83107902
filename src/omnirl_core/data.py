"""Prompt sources: a list, a .txt file (one per line) or a .jsonl file ({"prompt": ...} per line).

A .jsonl record (or a dict in a list) may carry more than the prompt: media for models that read them
(``image``, ``audio``, ``video``: a path or a list of paths, relative to the file's directory) and whatever a
reward compares against (e.g. ``answer``). They reach the rollout and the rewards as ``GenRequest.inputs``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from omnirl_core.errors import ConfigError

MEDIA_KEYS = ("image", "audio", "video")


def _media_paths(record: dict[str, Any], base: Path) -> dict[str, Any]:
    """Media paths relative to the data file's directory, made absolute (URLs and absolute paths kept)."""

    def fix(value: Any) -> Any:
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, str) and "://" not in value and not Path(value).is_absolute():
            return str(base / value)
        return value

    return {k: fix(v) if k in MEDIA_KEYS else v for k, v in record.items()}


def _check_prompt(record: dict[str, Any], where: str) -> None:
    prompt = record.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        got = "no 'prompt' key" if "prompt" not in record else f"'prompt' is {prompt!r}"
        raise ConfigError(f"{where}: a record needs a non-empty text 'prompt' ({got}).",
                          hint="Give every record a prompt string, or remove the record.")


def load_records(source: str | list[Any]) -> list[dict[str, Any]]:
    """Every prompt as a record ``{"prompt": str, ...other fields}``."""
    if isinstance(source, list):
        records = [dict(p) if isinstance(p, dict) else {"prompt": p} for p in source]
        for n, record in enumerate(records):
            _check_prompt(record, f"data.prompts[{n}]")
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"Prompt file '{source}' not found (data.prompts).",
                              hint="Pass a .txt (one prompt per line) or .jsonl file.")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            line = path.read_bytes()[:exc.start].count(b"\n") + 1
            raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {exc.start}: {exc.reason}).",
                              hint="Save the prompt file as UTF-8 (e.g. iconv -t UTF-8).") from None
        numbered = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        if path.suffix == ".jsonl":
            records = []
            for n, line in numbered:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{path}:{n}: not valid JSON ({exc.msg}).") from None
                if not isinstance(record, dict):
                    raise ConfigError(f"{path}:{n}: expected a JSON object with a 'prompt' key, got "
                                      f"{type(record).__name__}.")
                _check_prompt(record, f"{path}:{n}")
                records.append(_media_paths(record, path.parent))
        else:
            records = [{"prompt": line.strip()} for _, line in numbered]
    if not records:
        raise ConfigError("No prompts (data.prompts is empty).", hint="Give at least one prompt.")
    return records


def load_prompts(source: str | list[Any]) -> list[str]:
    return [record["prompt"] for record in load_records(source)]


class PromptSampler:
    """Deterministic per step: the prompts of step k depend only on (seed, k), so a resumed run sees
    exactly the prompts it would have seen."""

    def __init__(self, prompts: list[str], seed: int):
        self.prompts = prompts
        self.seed = seed

    def draw(self, step: int, count: int) -> list[tuple[int, str]]:
        rng = random.Random(self.seed * 1_000_003 + step)
        if count <= len(self.prompts):
            idx = rng.sample(range(len(self.prompts)), count)
        else:
            idx = [rng.randrange(len(self.prompts)) for _ in range(count)]
        return [(i, self.prompts[i]) for i in idx]
