"""The released Qwen-Image-Edit on the meta device: its parameter counts against the published figures, and the memory
plan's source-image tokens."""

from __future__ import annotations

from omnirl_plugin_qwen_image_edit.model import QwenImageEditOptions

from omnirl_core import testing


def test_plan_counts_the_released_architecture_and_the_source_tokens():
    from omnirl_plugin_qwen_image_edit.full_size import PUBLISHED, parameter_counts
    from omnirl_plugin_qwen_image_edit.sizing import _components, sizing

    from omnirl_core.config import build_config

    counts = parameter_counts(_components())
    for (variant, component), published in PUBLISHED.items():
        testing.check_matches_published(counts[component], published, f"{variant} {component}")
    config = build_config({"model": {"name": "qwen-image-edit"}, "rollout": {"height": 512, "width": 512}})
    released = sizing(config, QwenImageEditOptions())
    assert released.components["transformer"] == counts["transformer"] and released.probe is not None
    assert "4096 transformer tokens, 196 prompt vision tokens" in released.notes[-1]
    assert "1024 transformer tokens" in sizing(config, QwenImageEditOptions(vae_image_area=512 * 512)).notes[-1]
