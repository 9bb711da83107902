"""Discovery, registries, broken plugins, duplicate names, and a third-party plugin installed for real."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omnirl_core import hookimpl
from omnirl_core.errors import PluginError
from omnirl_core.plugins import PluginManager
from omnirl_core.registry import ModelSpec, RewardSpec

from .conftest import REPO, run_cli

FIXTURES = str(Path(__file__).parent / "fixture_plugins")


class _RewardPlugin:
    @hookimpl
    def omnirl_register_rewards(self, register):
        register(RewardSpec(name="aesthetic", factory="builtins:object"))


def test_registration_and_resolution(manager: PluginManager):
    manager.register(_RewardPlugin(), "aesthetic-plugin")
    spec = manager.resolve("reward", "aesthetic")
    assert spec.plugin == "aesthetic-plugin" and spec.qualified_name == "aesthetic-plugin:aesthetic"
    with pytest.raises(PluginError, match="Did you mean 'aesthetic'"):
        manager.resolve("reward", "aestetic")


def test_duplicate_names_need_the_qualified_name(manager: PluginManager):
    manager.register(_RewardPlugin(), "one")
    manager.register(_RewardPlugin(), "two")
    with pytest.raises(PluginError, match="ambiguous") as err:
        manager.resolve("reward", "aesthetic")
    assert "one:aesthetic" in err.value.render()
    assert manager.resolve("reward", "two:aesthetic").plugin == "two"


def test_wrong_spec_kind_marks_the_plugin_broken(manager: PluginManager):
    class Bad:
        @hookimpl
        def omnirl_register_rewards(self, register):
            register(ModelSpec(name="x", factory="builtins:object"))

    info = manager.register(Bad(), "bad")
    assert manager.plugins["bad"].status == "broken"
    assert "ModelSpec" in manager.plugins["bad"].error
    assert len(manager.registries["reward"]) == 0 and info.components == []


def _listing(*args: str, **env: str) -> subprocess.CompletedProcess:
    return run_cli(*args, env={"PYTHONPATH": FIXTURES, **env})


def test_broken_plugin_is_listed_and_does_not_take_the_cli_down():
    proc = _listing("list", "plugins", "--format", "json", OMNIRL_PLUGINS="broken_plugin,misspelt_plugin")
    assert proc.returncode == 0, proc.stderr
    rows = {row["name"]: row for row in json.loads(proc.stdout)}
    assert rows["broken_plugin"]["status"] == "broken"
    assert "broken on purpose" in rows["broken_plugin"]["error"]
    assert rows["misspelt_plugin"]["status"] == "broken"
    assert "omnirl_register_rewardz" in rows["misspelt_plugin"]["error"]
    assert rows["qwen-image"]["status"] == "ok"  # the installed first-party plugins still load
    # and the other listings keep working
    models = _listing("list", "models", "--format", "json", OMNIRL_PLUGINS="broken_plugin")
    assert models.returncode == 0 and "qwen-image" in {m["name"] for m in json.loads(models.stdout)}


def test_strict_mode_makes_a_broken_plugin_fatal():
    proc = _listing("list", "plugins", OMNIRL_PLUGINS="broken_plugin", OMNIRL_STRICT_PLUGINS="1")
    assert proc.returncode == 3
    assert "broken on purpose" in proc.stderr and "Traceback" not in proc.stderr


def test_disabled_plugins_are_skipped():
    proc = _listing("list", "plugins", "--format", "json", OMNIRL_DISABLE_PLUGINS="jpeg")
    rows = {row["name"]: row for row in json.loads(proc.stdout)}
    assert rows["jpeg"]["status"] == "disabled"
    rewards = {r["name"] for r in json.loads(_listing("list", "rewards", "--format", "json",
                                                       OMNIRL_DISABLE_PLUGINS="jpeg").stdout)}
    assert "jpeg" not in rewards


def test_cli_import_does_not_import_torch():
    code = ("import sys; sys.argv=['omnirl','--help']\nfrom omnirl_cli.main import run\n"
            "try:\n    run()\nexcept SystemExit:\n    pass\n"
            "sys.argv=['omnirl','plugins','list']\ntry:\n    run()\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert "TORCH False" in out.stdout, out.stdout[-500:] + out.stderr[-500:]


THIRD_PARTY = {
    "pyproject.toml": """
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "omnirl-plugin-brightness"
        version = "0.3.1"
        dependencies = []

        [project.entry-points."omnirl.plugins"]
        brightness = "omnirl_plugin_brightness"

        [tool.setuptools]
        packages = ["omnirl_plugin_brightness"]
    """,
    "omnirl_plugin_brightness/__init__.py": """
        from omnirl_core import hookimpl
        from omnirl_core.registry import RewardSpec


        def brightness(options=None):
            return lambda images, prompts: [float(im.mean()) for im in images]


        @hookimpl
        def omnirl_register_rewards(register):
            register(RewardSpec(name="brightness", factory="omnirl_plugin_brightness:brightness",
                                description="mean pixel value"))
    """,
}


def test_third_party_plugin_package_is_installed_and_discovered(tmp_path: Path):
    src = tmp_path / "omnirl-plugin-brightness"
    for rel, text in THIRD_PARTY.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    target = tmp_path / "site"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
         "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert pip.returncode == 0, pip.stderr
    proc = run_cli("list", "rewards", "--format", "json", env={"PYTHONPATH": str(target)})
    assert proc.returncode == 0, proc.stderr
    rewards = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rewards["brightness"]["plugin"] == "brightness"
    assert rewards["brightness"]["version"] == "0.3.1"
    plugins = {p["name"]: p for p in json.loads(run_cli("list", "plugins", "--format", "json",
                                                        env={"PYTHONPATH": str(target)}).stdout)}
    assert plugins["brightness"]["distribution"] == "omnirl-plugin-brightness"
    # without it on the path it is gone
    assert "brightness" not in run_cli("list", "rewards", "--format", "json").stdout
    assert (REPO / "CONTRIBUTING.md").is_file()


def _device_plugin(name: str, count: int, priority: int):
    from omnirl_core.registry import DeviceSpec

    class Device:
        @hookimpl
        def omnirl_register_devices(self, register):
            register(DeviceSpec(name=name, factory=lambda: count, torch_device=name, priority=priority))

    return Device()


def _raising_probe_plugin():
    from omnirl_core.registry import DeviceSpec

    def probe():
        raise RuntimeError("driver missing")

    class Device:
        @hookimpl
        def omnirl_register_devices(self, register):
            register(DeviceSpec(name="flaky", factory=probe, torch_device="flaky", priority=100))

    return Device()


def test_device_auto_picks_the_best_available(manager: PluginManager):
    from omnirl_core.resolve import resolve_device

    manager.register(_device_plugin("cpu", 1, 0), "cpu")
    manager.register(_device_plugin("cuda", 0, 10), "cuda")
    manager.register(_raising_probe_plugin(), "flaky")  # a probe that raises counts as unavailable
    assert resolve_device(manager, "auto").name == "cpu"
    with pytest.raises(PluginError, match="'cuda' is not available"):
        resolve_device(manager, "cuda")
    manager.register(_device_plugin("cuda2", 2, 10), "cuda2")
    assert resolve_device(manager, "auto").name == "cuda2"


def test_ambiguity_between_third_party_plugins_still_asks_for_the_qualified_name():
    from omnirl_core.errors import PluginError
    from omnirl_core.registry import Registry, RewardSpec

    registry = Registry("reward")
    for plugin, first in (("acme", False), ("other", False), ("ours", True)):
        spec = RewardSpec(name="score" if plugin != "ours" else "mine", factory=object, plugin=plugin)
        spec.first_party = first
        registry.add(spec)
    with pytest.raises(PluginError, match="ambiguous.*acme:score, other:score"):
        registry.resolve("score")
    assert registry.resolve("acme:score").plugin == "acme"


def test_every_plugin_of_this_repository_is_first_party():
    import tomllib

    from omnirl_core.plugins import FIRST_PARTY

    root = Path(__file__).resolve().parents[1]
    names = {tomllib.loads(p.read_text())["project"]["name"] for p in root.glob("plugins/*/*/pyproject.toml")}
    assert names and names <= FIRST_PARTY, sorted(names - FIRST_PARTY)


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``package(name, manifest, init="")``: a plugin package on sys.path, ``__init__.py`` and ``omnirl.toml``
    beside it; forgotten after the test."""
    made = []

    def make(name: str, manifest: str, init: str = "") -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(textwrap.dedent(init))
        (tmp_path / name / "omnirl.toml").write_text(textwrap.dedent(manifest))
        monkeypatch.syspath_prepend(str(tmp_path))
        made.append(name)
        return name

    yield make
    for name in made:
        sys.modules.pop(name, None)


MANIFEST = """
    [[reward]]
    name = "shade"
    aliases = ["tint"]
    factory = "builtins:object"
    modality = ["image", "video"]
    resources = { CPU = 1 }

    [[algorithm]]
    name = "shade-po"
    factory = "builtins:object"
    requires = ["flow-matching"]
    needs_ema = false
    [algorithm.preset_defaults.tiny.algorithm.options]
    beta = 2.0

    [[model]]
    name = "shady"
    factory = "builtins:object"
    capabilities = ["flow-matching", "image"]
    presets = ["tiny"]
    limits = { tiny = { size_multiple = 8 }, default = { size_multiple = 16 } }
    [model.preset_defaults.tiny]
    extends = "omnirl_core.presets:TINY_IMAGE_DEFAULTS"
    rollout = { height = 16 }
    model.options.max_sequence_length = 16
"""


def test_a_manifest_registers_its_components_with_the_spec_types(package, manager: PluginManager):
    from omnirl_core.presets import tiny_defaults
    from omnirl_core.registry import AlgorithmSpec, ModelLimits

    name = package("mf_shade", MANIFEST, init="""
        from omnirl_core import hookimpl
        from omnirl_core.registry import TrackerSpec


        @hookimpl
        def omnirl_register_trackers(register):  # a plugin may have both: a manifest and hooks
            register(TrackerSpec(name="shade-log", factory="builtins:object"))
    """)
    manager.load_modules([name])
    info = manager.plugins[name]
    assert info.status == "ok", info.error
    assert info.components == ["reward:shade", "algorithm:shade-po", "model:shady", "tracker:shade-log"]
    reward = manager.resolve("reward", "tint")
    assert isinstance(reward, RewardSpec) and reward.plugin == name
    assert reward.modality == ("image", "video") and reward.resources == {"CPU": 1.0}
    assert isinstance(reward.resources["CPU"], float) and reward.aliases == ("tint",)
    algorithm = manager.resolve("algorithm", "shade-po")
    assert isinstance(algorithm, AlgorithmSpec) and algorithm.requires == frozenset({"flow-matching"})
    assert algorithm.needs_ema is False and algorithm.needs_reference is False  # the field's default
    assert algorithm.preset_defaults == {"tiny": {"algorithm": {"options": {"beta": 2.0}}}}
    model = manager.resolve("model", "shady")
    assert model.capabilities == frozenset({"flow-matching", "image"}) and model.presets == ("tiny",)
    assert model.limits == {"tiny": ModelLimits(size_multiple=8), None: ModelLimits(size_multiple=16)}
    # extends: the rest of the preset's table deep-merged over the named dict
    assert model.preset_defaults == {"tiny": tiny_defaults(rollout={"height": 16},
                                                           model={"options": {"max_sequence_length": 16}})}
    assert model.preset_defaults["tiny"]["rollout"]["width"] == 32
    assert manager.resolve("tracker", "shade-log").plugin == name


@pytest.mark.parametrize("manifest,key,message", [
    ('[[reward]]\nname = "x"\nfactory = "builtins:object"\nmodalty = "image"\n', "modalty",
     "unknown key 'modalty'. Did you mean 'modality'?"),
    ('[[algorithm]]\nname = "x"\nfactory = "builtins:object"\nneeds_ema = "no"\n', "needs_ema",
     "'needs_ema' must be a boolean, not a string"),
    ('[[algorithm]]\nname = "x"\nfactory = "builtins:object"\nrequires = "flow-matching"\n', "requires",
     "'requires' must be an array of strings, not a string"),
    ('[[rewards]]\nname = "x"\nfactory = "builtins:object"\n', "rewards",
     "unknown component kind [[rewards]]. Did you mean 'reward'?"),
    ('[[reward]]\nname = "x"\n', "factory", "the key 'factory' is missing"),
    ('[[model]]\nname = "x"\nfactory = "f:g"\n[model.recipe_defaults]\nextends = "omnirl_core.presets:NOPE"\n',
     "extends", "'extends' = 'omnirl_core.presets:NOPE' does not load"),
])
def test_a_wrong_manifest_makes_the_plugin_broken(tmp_path, package, manager: PluginManager, manifest, key,
                                                  message):
    name = package(f"mf_bad_{key}", manifest)
    module = importlib.import_module(name)
    info = manager.register(module, name)
    assert info.status == "broken" and info.components == []
    assert str(tmp_path / name / "omnirl.toml") in info.error and message in info.error, info.error
    assert all(len(registry) == 0 for registry in manager.registries.values())
    strict = PluginManager()
    strict.strict = True  # strict mode: a wrong manifest is fatal, as a failing hook is
    with pytest.raises(PluginError, match=re.escape(message)):
        strict.register(module, name)


def test_every_first_party_manifest_is_valid_and_shipped():
    import tomllib

    from omnirl_core.manifest import parse_manifest

    manifests = sorted(REPO.glob("plugins/*/*/omnirl_plugin_*/omnirl.toml"))
    assert len(manifests) >= len(list(REPO.glob("plugins/*/*/pyproject.toml")))
    for manifest in manifests:
        package = manifest.parent.name
        assert parse_manifest(manifest.read_text(), package, str(manifest)), manifest
        setuptools = tomllib.loads((manifest.parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]
        shipped = setuptools.get("package-data", {}).get(package, [])
        for data in manifest.parent.glob("*.toml"):  # the manifest, published.toml, environment.toml
            assert data.name in shipped, f"{package}: add {data.name} to [tool.setuptools.package-data]"
