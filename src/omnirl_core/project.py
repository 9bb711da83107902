"""The project's names for pluggy and entry points, and the marker plugins put on their hooks (re-exported by
``omnirl_core``: ``from omnirl_core import hookimpl``)."""

import pluggy

__version__ = "0.1.0"

PROJECT = "omnirl"
ENTRY_POINT_GROUP = "omnirl.plugins"

hookimpl = pluggy.HookimplMarker(PROJECT)
"""Decorator plugins put on their hook implementations."""
