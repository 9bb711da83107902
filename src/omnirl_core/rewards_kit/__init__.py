"""Code the learned-reward plugins share (plugins never import each other): CLIP loading and preprocessing
(``clip``), tiny random-weight CLIP presets (``tiny_clip``), an edit's source images and mask (``sources``), and
``build_reward``: another installed reward by name, for rewards that wrap one (and for the reward server).
Importing this package loads nothing heavy; ``clip``, ``tiny_clip`` and ``sources``' functions import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnirl_core.plugins import PluginManager
    from omnirl_core.registry import RewardSpec


def build_reward(name: str, options: dict[str, Any] | None = None,
                 manager: PluginManager | None = None) -> tuple[Any, RewardSpec]:
    """(reward object, its RewardSpec) for an installed reward ``name`` and its options, validated as a run
    validates them (unknown keys are errors)."""
    from omnirl_core.config import validate_options

    if manager is None:
        from omnirl_core.plugins import get_plugin_manager

        manager = get_plugin_manager()
    spec = manager.resolve("reward", name)
    typed = validate_options(dict(options or {}), spec.load_config(), f"reward '{name}'")
    return spec.load_factory()(typed), spec
