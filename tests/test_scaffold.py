"""``omnirl plugin new KIND NAME``: the package installs with pip, is listed, and passes its own tests at once.

It is installed into a throwaway venv that sees this environment's packages (a ``.pth`` line), so the
plugins it adds never show up in the environment the rest of the suite runs in."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from omnirl_core.errors import UsageError
from omnirl_core.scaffold import KINDS, new_plugin


def _child_env(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True).create(path)
    python = path / "bin" / "python"
    child_site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    parent_site = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (Path(child_site) / "_omnirl_parent.pth").write_text(f"import site; site.addsitedir({parent_site!r})\n")
    return python


def test_new_plugins_of_every_kind_install_list_and_pass_their_tests(tmp_path: Path):
    names = {kind: f"my-{kind}" for kind in KINDS}
    dirs = [new_plugin(kind, name, tmp_path) for kind, name in names.items()]
    python = _child_env(tmp_path / "venv")
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                              *[arg for d in dirs for arg in ("-e", str(d))]], capture_output=True, text=True,
                             check=False)
    assert install.returncode == 0, install.stderr[-2000:]
    listed = subprocess.run([str(python), "-m", "omnirl_cli.main", "list", "plugins", "--format", "json"],
                            capture_output=True, text=True, check=False)
    assert listed.returncode == 0, listed.stderr
    status = {p["name"]: p["status"] for p in json.loads(listed.stdout)}
    assert all(status.get(name) == "ok" for name in names.values()), status
    tests = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *[str(d / "tests") for d in dirs]], capture_output=True, text=True, cwd=tmp_path,
                           check=False)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and "failed" not in tests.stdout


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
