"""The hook specifications: registrations computed in Python. Each receives a ``register`` callback.

A plugin usually declares its components as data, in an ``omnirl.toml`` manifest beside its
``__init__.py`` (``omnirl_core.manifest``)::

    [[reward]]
    name = "my-reward"
    factory = "my_pkg.reward:MyReward"

A registration that must be computed implements the hook of its kind with ``@omnirl_core.hookimpl``
instead (a plugin may have both)::

    @hookimpl
    def omnirl_register_rewards(register):
        register(RewardSpec(name="my-reward", factory="my_pkg.reward:MyReward"))

Factories and config classes may be given as ``"module:attr"`` strings so that importing the
plugin module stays cheap (no torch); they are imported only when a run selects the component.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from omnirl_core.project import PROJECT
from omnirl_core.registry import ComponentSpec

hookspec = pluggy.HookspecMarker(PROJECT)

Register = Callable[[ComponentSpec], None]


@hookspec
def omnirl_register_models(register: Register) -> None:
    """Register model plugins: call ``register(ModelSpec(...))`` once per model.

    A model declares its capabilities (``flow-matching``, ``sde-logprob``, ``cfg``, ``lora``, ``image``,
    ``video``, ``ar-text``, ...), its presets (``tiny`` builds the architecture with random weights) and
    the recipe values it suggests (resolution, steps, guidance, default reward)."""


@hookspec
def omnirl_register_algorithms(register: Register) -> None:
    """Register RL algorithms: ``register(AlgorithmSpec(...))``; an algorithm names the model
    capabilities it requires and whether it needs log-probs, a reference model, pairs or an EMA."""


@hookspec
def omnirl_register_engines(register: Register) -> None:
    """Register engines: ``register(EngineSpec(...))`` with its roles (``rollout``, ``train``) and the
    device types it supports."""


@hookspec
def omnirl_register_rewards(register: Register) -> None:
    """Register rewards: ``register(RewardSpec(...))`` with the input modality it scores."""


@hookspec
def omnirl_register_devices(register: Register) -> None:
    """Register hardware: ``register(DeviceSpec(...))`` with a cheap probe that never raises, the torch
    device type, the distributed backend, the Ray resource name and the visible-devices variable."""


@hookspec
def omnirl_register_trackers(register: Register) -> None:
    """Register experiment trackers: ``register(TrackerSpec(...))``. A tracker's factory takes its validated
    options and returns an object with ``start(run)``, ``log(event)`` and ``close()`` (see
    ``omnirl_core.loop.trackers``); it receives every step's metrics row after the row is written, and the sample
    grids. A tracker that fails is logged and never fails the run."""


KINDS = ("model", "algorithm", "engine", "reward", "device", "tracker")
"""The component kinds: a manifest's tables (``[[model]]``, ...), the hooks ``omnirl_register_<kind>s``."""
HOOK_FOR_KIND = {kind: f"omnirl_register_{kind}s" for kind in KINDS}
