"""The start of a driver script that brings up a run's local Ray instance exactly as ``--executor ray`` does
(``RayExecutor._connect`` on a resolved tiny run), for the fault tests that watch Ray's processes from outside."""

PREAMBLE = """
import json, sys, time
import psutil
from omnirl_core.plugins import PluginManager
from omnirl_core.resolve import resolve_run
from omnirl_core.loop.ray_executor import RayExecutor

manager = PluginManager()
manager.load_modules(["omnirl_plugin_cpu", "omnirl_plugin_qwen_image", "omnirl_plugin_flowgrpo",
                      "omnirl_plugin_diffusers", "omnirl_plugin_torch", "omnirl_plugin_color"])
resolved = resolve_run(manager, [{"model": {"name": "qwen-image", "preset": "tiny"},
                                  "algorithm": {"name": "flowgrpo"}, "rewards": [{"name": "color"}],
                                  "run": {"executor": "ray", "device": "cpu"}}], probe_device=False)
executor = RayExecutor(resolved)
executor._connect()
import ray
"""
