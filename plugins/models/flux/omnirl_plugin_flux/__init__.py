"""omnirl model plugin: FLUX.1 (diffusers). Importing this module is cheap: no torch."""

import json
from pathlib import Path

from omnirl_core.registry import ModelLimits

HUB_IDS = {"dev": "black-forest-labs/FLUX.1-dev", "schnell": "black-forest-labs/FLUX.1-schnell"}


def limits(section, options) -> ModelLimits:
    """Sizes: VAE x8 times 2x2 packing (the tiny VAE: x4). Guidance: embedded when the transformer has a guidance
    embedding (dev, tiny), none otherwise (schnell); a local checkpoint says which in its config."""
    if section.preset == "tiny":
        schnell = options is not None and options.tiny_variant == "schnell"
        return ModelLimits(guidance="none" if schnell else "embedded", size_multiple=8)
    path = section.path or HUB_IDS.get(section.preset or "dev", HUB_IDS["dev"])
    config = Path(path).expanduser() / "transformer" / "config.json"
    if config.is_file():
        embedded = json.loads(config.read_text()).get("guidance_embeds", False)
    else:
        embedded = "schnell" not in path.lower()
    return ModelLimits(guidance="embedded" if embedded else "none", size_multiple=16)
