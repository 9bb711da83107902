"""mypy over the core and the CLI, with the contracts as types: the configuration is pyproject.toml's
``[tool.mypy]`` (third-party libraries without stubs, and the large fast-moving ones, are ``Any`` there)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (it comes with the dev extra: pip install -e .[dev])")
def test_mypy_is_clean_on_the_core_and_the_cli():
    out = subprocess.run([sys.executable, "-m", "mypy", "src/omnirl_core", "cli/omnirl_cli"], cwd=ROOT,
                         capture_output=True, text=True, timeout=1200, check=False)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
