"""Core tests: plugins are registered explicitly, never autoloaded from whatever is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnirl_core.plugins import PluginManager, set_plugin_manager

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def manager():
    """An empty, isolated plugin manager installed as the process-wide one for the test."""
    m = PluginManager()
    set_plugin_manager(m)
    yield m
    set_plugin_manager(None)


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: int = 300):
    """Run the real `omnirl` console script in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    exe = Path(sys.executable).with_name("omnirl")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, env=full_env,
                          cwd=str(cwd) if cwd else None, timeout=timeout, check=False)
