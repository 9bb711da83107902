"""Every recipe under recipes/ resolves (config, plugin options, capabilities) and builds its algorithm,
and its header names the command that runs it and the hardware it assumes."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnirl_core.config import load_recipe
from omnirl_core.contracts import RolloutPlan
from omnirl_core.plugins import PluginManager
from omnirl_core.resolve import resolve_run

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))
PLUGINS = [
    "omnirl_plugin_qwen_image", "omnirl_plugin_flowgrpo", "omnirl_plugin_mixgrpo", "omnirl_plugin_dancegrpo",
    "omnirl_plugin_grpo_guard", "omnirl_plugin_dpo", "omnirl_plugin_nft", "omnirl_plugin_diffusers",
    "omnirl_plugin_torch", "omnirl_plugin_fsdp2", "omnirl_plugin_ocr", "omnirl_plugin_cpu", "omnirl_plugin_cuda",
    "omnirl_plugin_wan22", "omnirl_plugin_sd35", "omnirl_plugin_color", "omnirl_plugin_qwen3_omni",
    "omnirl_plugin_gspo", "omnirl_plugin_transformers", "omnirl_plugin_answer_match", "omnirl_plugin_pickscore",
    "omnirl_plugin_hpsv2", "omnirl_plugin_imagereward", "omnirl_plugin_geneval", "omnirl_plugin_video",
    "omnirl_plugin_bagel", "omnirl_plugin_flux", "omnirl_plugin_qwen_image_edit", "omnirl_plugin_edit_consistency",
    "omnirl_plugin_vlm_judge", "omnirl_plugin_veomni",
]


@pytest.fixture(scope="module")
def manager() -> PluginManager:
    m = PluginManager()
    m.load_modules(PLUGINS)
    return m


def test_there_are_recipes():
    assert len(RECIPES) >= 9


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_resolves_and_builds_its_algorithm(path: Path, manager: PluginManager, tmp_path: Path):
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    text = "\n".join(header)
    assert f"omnirl train --recipe recipes/{path.relative_to(REPO / 'recipes')}" in text
    assert "Hardware:" in text
    layer = load_recipe(path)
    options = layer.get("algorithm", {}).get("options", {})
    if options.get("preference_file"):  # an offline recipe names a file the user supplies
        prefs = tmp_path / "prefs.jsonl"
        from PIL import Image

        Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
        prefs.write_text('{"prompt": "p", "chosen": "a.png", "rejected": "a.png"}\n')
        options["preference_file"] = str(prefs)
    resolved = resolve_run(manager, [layer], probe_device=False)
    algorithm = resolved.algorithm.load_factory()(resolved.options.get("algorithm.options"), resolved.config)
    assert isinstance(algorithm.plan(1), RolloutPlan)  # token-level algorithms plan no denoising steps
