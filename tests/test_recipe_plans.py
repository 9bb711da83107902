"""Every recipe for released checkpoints fits the hardware its header names: its ``# Plan:`` line is an
``omnirl plan`` command with the device's memory, and the memory plan (full-size architectures on the meta device)
stays within that memory. Recipes of a random-weight preset run on any CPU and are not planned."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from omnirl_core.config import load_recipe
from omnirl_core.planning.planner import parse_bytes, plan_memory
from omnirl_core.plugins import PluginManager
from omnirl_core.resolve import resolve_run

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))
PLANNED = [p for p in RECIPES if "preset" not in load_recipe(p).get("model", {})]


@pytest.fixture(scope="module")
def manager() -> PluginManager:
    from tests.test_recipes import PLUGINS

    m = PluginManager()
    m.load_modules(PLUGINS)
    return m


def _plan_command(path: Path) -> list[str]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("# Plan:")]
    assert len(lines) == 1, f"{path.name}: the header needs one '# Plan: omnirl plan ...' line"
    argv = shlex.split(lines[0].removeprefix("# Plan:").split("#")[0])
    assert argv[:2] == ["omnirl", "plan"] and "--device-memory" in argv, lines[0]
    assert argv[argv.index("--recipe") + 1] == str(path.relative_to(REPO)), lines[0]
    return argv


@pytest.mark.parametrize("path", PLANNED, ids=[p.name for p in PLANNED])
def test_recipe_fits_the_hardware_its_header_names(path: Path, manager: PluginManager):
    name = load_recipe(path)["model"]["name"]
    if not any(name in (m.name, *m.aliases) for m in manager.registries["model"]):
        pytest.skip(f"model '{name}': its plugin is not among tests/test_recipes.py's PLUGINS")
    model = manager.resolve("model", name)
    if getattr(model, "sizing", None) is None:
        pytest.skip(f"model '{model.name}' does not describe its full-size architecture yet (ModelSpec.sizing)")
    argv = _plan_command(path)
    memory = parse_bytes(argv[argv.index("--device-memory") + 1])
    hardware = " ".join(line for line in path.read_text().splitlines() if line.startswith("# Hardware"))
    named = re.search(r"(\d+)\s*GB", hardware)
    assert named, f"{path.name}: the Hardware line names no device memory"
    assert abs(memory - int(named.group(1)) * 10**9) <= 0.1 * memory, (hardware, memory)
    resolved = resolve_run(manager, [load_recipe(path)], probe_device=False)
    plan = plan_memory(resolved, memory, suggest=False)
    print(f"{path.name}\n{plan.table()}")
    assert plan.fits, plan.table()
