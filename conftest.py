"""Test-session settings for the whole repository (tests/ and every plugin's tests).

``long``: learning-curve runs of several minutes each (a tiny training run whose reward must rise). They
prove a result once; the default test run (and CI) skips them. Run them with ``OMNIRL_LONG=1 pytest -m long``.

Order: with ``-n 2 --dist loadfile`` each worker takes whole files from a queue. The files that take longest start
first (``LONGEST_FIRST``, then any file with a ``slow`` test, then the rest), so that the short ones fill in at the
end instead of two long files running alone while the other worker idles; pytest-xdist's own reordering (files
with the most tests first) is turned off for that."""

import os

import pytest

LONGEST_FIRST = (
    # the longest test files, longest first (seconds on 2 cores, from --durations: 385, 330, 300, 250, 250, 230, ...)
    "tests/test_crash_consistency.py",
    "tests/test_main_job.py",
    "plugins/engines/megatron/tests/test_megatron.py",
    "tests/test_cluster.py",
    "plugins/engines/fsdp2/tests/test_fsdp2.py",
    "tests/test_scaffold.py",
    "tests/test_ray_executor.py",
    "tests/test_bad_inputs.py",
    "tests/test_faults_limits.py",
    "plugins/algorithms/nft/tests/test_nft.py",
    "plugins/rewards/remote/tests/test_remote.py",
    "tests/test_algorithm_state.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist >= 3.6
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    slow_files = {item.nodeid.split("::", 1)[0] for item in items if "slow" in item.keywords}
    rank = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path not in rank:
            rank[path] = (0, LONGEST_FIRST.index(path)) if path in LONGEST_FIRST else (1 if path in slow_files else 2, 0)
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])  # stable: a file's tests keep their order
    if os.environ.get("OMNIRL_LONG"):
        return
    skip = pytest.mark.skip(reason="a learning-curve run of minutes: set OMNIRL_LONG=1 to run it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
