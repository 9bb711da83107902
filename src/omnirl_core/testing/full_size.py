"""The full-size checks every model plugin's tests share, as a pytest base class.

    from omnirl_plugin_x import full_size
    from omnirl_core.testing.full_size import FullSizeSuite

    class TestFullSize(FullSizeSuite):
        full_size = full_size
        components = {"base": {"transformer", "vae", "text_encoder"}}

        def test_the_layout_is_the_released_one(self, built):
            transformer = built["base"][0]["transformer"]
            ...

``full_size`` is the plugin's module with ``full_size_components(variant)``, ``parameter_counts(variant,
components)`` and ``PUBLISHED`` (``omnirl_core.planning.sizing.published_counts``). The class builds every variant
once on the meta device (the ``built`` fixture: variant -> (modules, seconds, MiB grown)) and checks that the
build holds no storage, has the named components, and that every published count is met.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from omnirl_core import testing


class FullSizeSuite:
    full_size: ClassVar[Any]
    """The plugin's ``full_size`` module."""
    components: ClassVar[dict[str, set[str]]]
    """The component names each variant builds."""
    max_seconds: ClassVar[float] = 30.0

    @pytest.fixture(scope="class")
    def built(self) -> dict[str, Any]:
        return testing.build_on_meta(self.full_size.full_size_components, tuple(self.components))

    def test_full_size_is_built_on_meta_in_seconds_without_memory(self, built):
        for variant, names in self.components.items():
            assert set(built[variant][0]) == names, variant
            testing.check_on_meta(*built[variant], max_seconds=self.max_seconds)

    def test_parameter_counts_match_the_published_figures(self, built):
        published = self.full_size.PUBLISHED
        assert published and {variant for variant, _ in published} <= set(self.components)
        for (variant, component), figure in published.items():
            counts = self.full_size.parameter_counts(variant, built[variant][0])
            testing.check_matches_published(counts[component], figure, f"{variant} {component}")
