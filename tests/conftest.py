"""Core tests: plugins are registered explicitly, never autoloaded from whatever is installed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omnirl_core.plugins import PluginManager, set_plugin_manager
from omnirl_core.testing.forkserver import run_omnirl

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def manager():
    """An empty, isolated plugin manager installed as the process-wide one for the test."""
    m = PluginManager()
    set_plugin_manager(m)
    yield m
    set_plugin_manager(None)


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: int = 300):
    """Run the real `omnirl` console script in a process of its own (forked from a server that has imported
    torch and co. already: ``omnirl_core.testing.forkserver``)."""
    return run_omnirl(list(args), env={**os.environ, **(env or {})}, cwd=cwd, timeout=timeout)
