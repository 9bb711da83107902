"""Shared by the training-loop benchmarks: a Controller on the tiny Qwen-Image preset, driven one step at
a time so that two settings can alternate within one run (machine load then hits both alike)."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from omnirl_core.host.threads import apply_env

apply_env()  # the thread policy a CLI run gets (OpenMP threads, spin-then-sleep), set before torch loads

from omnirl_core.loop.controller import Controller
from omnirl_core.plugins import PluginManager
from omnirl_core.resolve import resolve_run

RESULTS = Path(__file__).with_name("results")
PLUGINS = ["omnirl_plugin_cpu", "omnirl_plugin_qwen_image", "omnirl_plugin_flowgrpo", "omnirl_plugin_diffusers",
           "omnirl_plugin_torch", "omnirl_plugin_color", "omnirl_plugin_jpeg", "omnirl_plugin_ocr", "omnirl_plugin_vlm_judge",
           "omnirl_plugin_remote"]


def controller(out: Path, overrides: dict[str, Any], plugins: tuple[str, ...] = ()) -> Controller:
    """A controller over ``PLUGINS`` and ``plugins`` (more plugin modules)."""
    from omnirl_core.config import deep_merge

    manager = PluginManager()
    manager.load_modules([*PLUGINS, *plugins])
    base = {"model": {"name": "qwen-image", "preset": "tiny"}, "algorithm": {"name": "flowgrpo"},
            "run": {"output_dir": str(out), "device": "cpu", "save_every": 10_000, "sample_every": 10_000}}
    resolved = resolve_run(manager, [deep_merge(base, overrides)])
    ctl = Controller(resolved, out)
    ctl.run_dir.prepare(resolved.dump(), [])
    return ctl


def mean(records: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return statistics.fmean(values) if values else float("nan")


def machine() -> dict[str, Any]:
    """The CPU a figure was measured on: model name and the vector / matrix extensions that change kernel
    speed (a ratio measured with AVX-512 or AMX did not hold on an AVX2-only machine)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:  # not Linux: the model from platform, no flags
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
    return {"cpu_model": model, "cpu_flags": [f for f in wanted if f in flags]}


def describe(env: dict[str, Any]) -> str:
    """One line naming the machine and its load, for a benchmark's printed summary."""
    flags = ", ".join(env.get("cpu_flags") or ["no AVX2"])
    return f"{env['cpu_model']} ({env['cpus']} CPUs; {flags}); load average {env['load_avg_1m']:.2f}"


def environment() -> dict[str, Any]:
    import os

    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            **machine(), "load_avg_1m": os.getloadavg()[0], "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def write(name: str, result: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
