"""omnirl core: the contracts (``omnirl_core.contracts``), hook specs, discovery, registries, config, the math
(``flow``, ``ar``, ``rl``), the step loop and the run directory.

The Python API is ``train``, ``evaluate`` and ``plan`` (``omnirl_core.api``), what the CLI's commands call.
Importing this package is cheap: no torch. Modules that need torch import it themselves.
"""

from omnirl_core.api import evaluate, plan, train
from omnirl_core.project import ENTRY_POINT_GROUP, PROJECT, __version__, hookimpl

__all__ = ["ENTRY_POINT_GROUP", "PROJECT", "__version__", "evaluate", "hookimpl", "plan", "train"]
