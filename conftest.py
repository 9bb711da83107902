"""Test-session settings for the whole repository (tests/ and every plugin's tests).

``long``: learning-curve runs of several minutes each (a tiny training run whose reward must rise). They
prove a result once; the default test run (and CI) skips them. Run them with ``OMNIRL_LONG=1 pytest -m long``."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("OMNIRL_LONG"):
        return
    skip = pytest.mark.skip(reason="a learning-curve run of minutes: set OMNIRL_LONG=1 to run it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
