"""Environments of their own: the declaration file, where a built one lives, the errors when it is not built."""

from __future__ import annotations

import pytest

from omnirl_core.errors import UsageError
from omnirl_core.serving.envs import (
    environment_dir,
    environment_python,
    is_built,
    parse_environment,
)

TOML = """
description = "an engine"
requirements = ["engine==1.0"]
remove = ["cuda-only-thing"]
check = "import engine"
[variants.cpu]
requirements = ["engine-cpu==1.0"]
post_install = ["engine_fix"]
[variants.cuda]
requirements = ["engine-cuda==1.0"]
[env]
ENGINE_DEVICE = "{device}"
"""


def test_variants_add_to_the_common_declaration():
    cpu = parse_environment(TOML, "eng", "cpu")
    cuda = parse_environment(TOML, "eng", "cuda")
    assert cpu.requirements == ("engine==1.0", "engine-cpu==1.0")
    assert cuda.requirements == ("engine==1.0", "engine-cuda==1.0")
    assert cpu.remove == ("cuda-only-thing",) and cpu.post_install == ("engine_fix",) and cuda.post_install == ()
    assert cpu.env == {"ENGINE_DEVICE": "cpu"} and cuda.env == {"ENGINE_DEVICE": "cuda"}
    assert cpu.key() != cuda.key() and cpu.key() == parse_environment(TOML, "eng", "cpu").key()


def test_bad_declarations_are_refused():
    with pytest.raises(UsageError, match="unknown keys \\['requirement'\\]"):
        parse_environment('requirement = ["x"]', "eng", "cpu")
    with pytest.raises(UsageError, match="declares no requirements"):
        parse_environment('description = "x"', "eng", "cpu")
    with pytest.raises(UsageError, match="Unknown device kind 'npu'"):
        parse_environment(TOML, "eng", "npu")


def test_an_unbuilt_environment_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIRL_CACHE", str(tmp_path))
    monkeypatch.delenv("OMNIRL_ENV_ENG", raising=False)
    env = parse_environment(TOML, "eng", "cpu", source="plugin/environment.toml")
    assert environment_dir(env).parent == tmp_path / "envs" and not is_built(env)
    with pytest.raises(UsageError) as info:
        environment_python(env)
    assert info.value.exit_code == 2
    assert "omnirl env build eng" in info.value.hint and "OMNIRL_ENV_ENG" in info.value.hint


def test_an_override_points_at_an_existing_environment(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    env = parse_environment(TOML, "eng", "cpu")
    monkeypatch.setenv("OMNIRL_ENV_ENG", str(venv))
    assert environment_python(env) == venv / "bin" / "python" and is_built(env)
    monkeypatch.setenv("OMNIRL_ENV_ENG", str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="does not exist"):
        environment_python(env)


def test_plugins_are_declared_and_leave_the_hash_alone():
    """``plugins = true``: the project's plugins go in too, kept in step at each use, so they are not hashed
    (installing a plugin never invalidates a built environment)."""
    with_plugins = parse_environment("plugins = true\n" + TOML, "eng", "cpu")
    assert with_plugins.plugins and not parse_environment(TOML, "eng", "cpu").plugins
    assert with_plugins.key() == parse_environment(TOML, "eng", "cpu").key()


def test_sync_installs_the_plugins_an_environment_lacks_once(tmp_path, monkeypatch):
    """A real virtual environment without omnirl: the sync installs (no dependencies) a plugin the project has
    and it lacks, visible there by its entry point; a second sync installs nothing."""
    import json
    import subprocess
    import sys

    from omnirl_core.serving import envs

    package = tmp_path / "plugin"
    (package / "omnirl_plugin_probe").mkdir(parents=True)
    (package / "omnirl_plugin_probe" / "__init__.py").write_text("")
    (package / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "omnirl-plugin-probe"\nversion = "0.3.0"\ndependencies = ["a-package-that-is-not-there"]\n'
        '[project.entry-points."omnirl.plugins"]\nprobe = "omnirl_plugin_probe"\n'
        '[tool.setuptools]\npackages = ["omnirl_plugin_probe"]\n')
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    monkeypatch.setattr(envs, "project_plugins", lambda: {"omnirl-plugin-probe": ("0.3.0", str(package))})
    env = parse_environment("plugins = true\n" + TOML, "eng", "cpu")
    assert envs.sync_plugins(env, python) == ["omnirl-plugin-probe"]
    listed = subprocess.run([str(python), "-c", envs._LIST_PLUGINS], capture_output=True, text=True, check=True)
    assert json.loads(listed.stdout) == {"omnirl-plugin-probe": ["0.3.0", str(package)]}
    assert envs.sync_plugins(env, python) == []


def test_a_train_engine_with_an_environment_of_its_own_is_run_there(tmp_path):
    """veomni declares its environment and is not importable here: an inline ``omnirl train`` says how to build the
    environment it would continue in (exit 2), the Python API refuses an inline run with the ways that work, and
    an engine of this environment (torch) needs none."""
    import os
    import subprocess
    import sys

    from omnirl_core.plugins import get_plugin_manager
    from omnirl_core.serving.envs import worker_environment

    manager = get_plugin_manager()
    assert worker_environment(manager.resolve("engine", "torch")) is None
    needed = worker_environment(manager.resolve("engine", "veomni"), "cpu")
    assert needed is not None and needed.name == "veomni" and needed.plugins

    env = {**os.environ, "OMNIRL_CACHE": str(tmp_path / "cache")}
    env.pop("OMNIRL_ENV_VEOMNI", None)
    args = ["--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny", "--set", "train.engine=veomni"]
    cli = subprocess.run([str(os.path.join(os.path.dirname(sys.executable), "omnirl")), "train", "-o",
                          str(tmp_path / "run"), *args], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert cli.returncode == 2, cli.stderr[-2000:]
    assert "environment of 'veomni'" in cli.stderr and "omnirl env build veomni" in cli.stderr
    script = ("import omnirl_core\nfrom omnirl_core.errors import UsageError\ntry:\n"
              "    omnirl_core.train({'model': {'name': 'qwen-image', 'preset': 'tiny'}, 'algorithm': {'name': "
              "'flowgrpo'}, 'train': {'engine': 'veomni'}})\nexcept UsageError as exc:\n"
              "    print(exc.message, '|', exc.hint)\n")
    api = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                         check=True)
    assert "runs in its own environment 'veomni'" in api.stdout and "run.executor=ray" in api.stdout
