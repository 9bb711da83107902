"""omnirl model plugin: FLUX.1 (diffusers). Importing this module is cheap: no torch."""

import json
from pathlib import Path

from omnirl_core import hookimpl
from omnirl_core.presets import tiny_defaults
from omnirl_core.registry import ModelLimits, ModelSpec

HUB_IDS = {"dev": "black-forest-labs/FLUX.1-dev", "schnell": "black-forest-labs/FLUX.1-schnell"}


@hookimpl
def omnirl_register_models(register):
    register(
        ModelSpec(
            name="flux.1",
            aliases=("flux", "flux1", "flux.1-dev", "flux.1-schnell"),
            description="FLUX.1 text-to-image via diffusers: dev (guidance-distilled, the scale is an input) or "
            "schnell (few steps, no guidance); CLIP + T5 text encoders.",
            factory="omnirl_plugin_flux.model:create_model",
            config="omnirl_plugin_flux.model:FluxOptions",
            capabilities=frozenset({"flow-matching", "sde-logprob", "lora", "image"}),
            presets=("tiny", "dev", "schnell"),
            default_path=HUB_IDS["dev"],
            limits="omnirl_plugin_flux:limits",
            recipe_defaults={
                "rollout": {"height": 512, "width": 512, "num_steps": 16, "guidance_scale": 3.5},
                "rewards": [{"name": "jpeg"}],
            },
            preset_defaults={
                "tiny": tiny_defaults(model={"options": {"max_sequence_length": 16}}),
                "schnell": {"rollout": {"num_steps": 4, "guidance_scale": 1.0}},
            },
        )
    )


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
