"""``python -m omnirl_cli``: the ``omnirl`` command (how a run continues in another environment's interpreter)."""

from omnirl_cli.main import run

run()
