"""omnirl core: hook specs, discovery, registries, config, sampler math and the controller loop.

Importing this package is cheap: no torch. Modules that need torch import it themselves.
"""

import pluggy

__version__ = "0.1.0"

PROJECT = "omnirl"
ENTRY_POINT_GROUP = "omnirl.plugins"

hookimpl = pluggy.HookimplMarker(PROJECT)
"""Decorator plugins put on their hook implementations."""

__all__ = ["ENTRY_POINT_GROUP", "PROJECT", "__version__", "hookimpl"]
