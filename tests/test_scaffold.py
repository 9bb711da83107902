"""``omnirl plugin new KIND NAME``: the package installs with pip, is listed, and passes its own tests at once.

It is installed into a throwaway venv that sees this environment's packages (a ``.pth`` line) and has an
``omnirl`` console script of its own (the generated model's tests drive it), so the plugins it adds never show up
in the environment the rest of the suite runs in."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from omnirl_core.errors import UsageError
from omnirl_core.scaffold import KINDS, new_plugin

from .conftest import run_cli


def _child_env(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True).create(path)
    python = path / "bin" / "python"
    child_site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    parent_site = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (Path(child_site) / "_omnirl_parent.pth").write_text(f"import site; site.addsitedir({parent_site!r})\n")
    # the plugins build with the parent's setuptools (pip --no-build-isolation: no build environment to install per
    # plugin), not the older copy ensurepip bundles
    for old in Path(child_site).glob("setuptools*"):
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    script = path / "bin" / "omnirl"  # what installing omnirl into the venv would write
    script.write_text(f"#!{python}\nimport sys\nfrom omnirl_cli.main import run\nsys.exit(run())\n")
    script.chmod(0o755)
    return python


def _listed(python: Path, kind: str) -> list[dict]:
    out = subprocess.run([str(python), "-m", "omnirl_cli.main", "list", kind, "--format", "json"],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_new_plugins_of_every_kind_install_list_and_pass_their_tests(tmp_path: Path):
    names = {kind: f"my-{kind}" for kind in KINDS}
    dirs = [new_plugin(kind, name, tmp_path) for kind, name in names.items()]
    python = _child_env(tmp_path / "venv")
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              *[arg for d in dirs for arg in ("-e", str(d))]], capture_output=True, text=True,
                             check=False)
    assert install.returncode == 0, install.stderr[-2000:]
    status = {p["name"]: p["status"] for p in _listed(python, "plugins")}
    assert all(status.get(name) == "ok" for name in names.values()), status
    models = {m["name"]: m for m in _listed(python, "models")}
    assert "cfg" in models[names["model"]]["capabilities"] and models[names["model"]]["presets"] == ["tiny"]
    engines = {e["name"]: e for e in _listed(python, "engines")}
    assert engines[names["engine"]]["roles"] == ["rollout"]
    # the generated model's preset is built into a cache of this test's own
    env = {**os.environ, "OMNIRL_CACHE": str(tmp_path / "cache")}
    tests = subprocess.run([str(python), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                            *[str(d / "tests") for d in dirs]], capture_output=True, text=True, cwd=tmp_path,
                           check=False, env=env)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and "failed" not in tests.stdout and "skipped" not in tests.stdout, \
        tests.stdout[-3000:]
    # the model's suites ran on its tiny preset, and its end-to-end test trained it through the CLI
    assert (tmp_path / "cache" / "presets" / "my-model-tiny-v1-seed0" / "model_index.json").is_file()


@pytest.mark.parametrize("kind,name", [("model-x", "ok-name"), ("reward", "Bad_Name"), ("reward", "-x")])
def test_bad_kind_or_name_is_a_usage_error(tmp_path: Path, kind: str, name: str):
    with pytest.raises(UsageError):
        new_plugin(kind, name, tmp_path)
    assert not any(tmp_path.iterdir())


def test_an_existing_directory_is_never_overwritten(tmp_path: Path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    with pytest.raises(UsageError, match="exists already"):
        new_plugin("reward", "mine", tmp_path)
    assert (tmp_path / "mine" / "keep.txt").read_text() == "x"


@pytest.mark.parametrize("kind,files", [
    ("model", ("omnirl_plugin_acme_t2i/model.py", "omnirl_plugin_acme_t2i/tiny.py", "tests/test_acme_t2i.py")),
    ("engine", ("omnirl_plugin_acme_t2i/engine.py", "tests/test_acme_t2i.py")),
])
def test_the_cli_writes_model_and_engine_plugins(tmp_path: Path, kind: str, files: tuple[str, ...]):
    out = run_cli("plugin", "new", kind, "acme-t2i", "--dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"wrote {tmp_path / 'acme-t2i'}" in out.stderr
    for rel in ("pyproject.toml", "omnirl_plugin_acme_t2i/omnirl.toml", *files):
        assert (tmp_path / "acme-t2i" / rel).is_file(), rel
    manifest = (tmp_path / "acme-t2i" / "omnirl_plugin_acme_t2i" / "omnirl.toml").read_text()
    assert manifest.startswith(f'[[{kind}]]\nname = "acme-t2i"\n')


def test_the_cli_names_every_kind_for_an_unknown_one(tmp_path: Path):
    out = run_cli("plugin", "new", "sampler", "x", "--dir", str(tmp_path))
    assert out.returncode == 2
    assert "Choose one of: reward, algorithm, tracker, device, model, engine." in out.stderr
