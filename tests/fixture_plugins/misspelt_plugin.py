"""Test plugin with a misspelt hook name: must be reported as broken, not silently ignored."""

from omnirl_core import hookimpl


@hookimpl
def omnirl_register_rewardz(register):
    pass
