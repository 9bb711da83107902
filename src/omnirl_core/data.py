"""Prompt sources: a list, a .txt file (one per line) or a .jsonl file ({"prompt": ...} per line)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from omnirl_core.errors import ConfigError


def load_prompts(source: str | list[str]) -> list[str]:
    if isinstance(source, list):
        prompts = [str(p) for p in source]
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"Prompt file '{source}' not found (data.prompts).",
                              hint="Pass a .txt (one prompt per line) or .jsonl file.")
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        if path.suffix == ".jsonl":
            prompts = []
            for n, line in enumerate(lines, 1):
                try:
                    prompts.append(str(json.loads(line)["prompt"]))
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise ConfigError(f"{path}:{n}: expected a JSON object with a 'prompt' key.") from exc
        else:
            prompts = [line.strip() for line in lines]
    if not prompts:
        raise ConfigError("No prompts (data.prompts is empty).", hint="Give at least one prompt.")
    return prompts


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
