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
