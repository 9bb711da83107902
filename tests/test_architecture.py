"""The boundaries the folder tree promises: the core imports no plugin, no plugin (its tests included)
imports another plugin, and the core's modules import each other without a cycle (lazy imports inside
functions count too: a cycle there is the same tangle, only deferred)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "src" / "omnirl_core"
PLUGIN_DIRS = sorted(p for kind in (ROOT / "plugins").iterdir() if kind.is_dir() for p in kind.iterdir()
                     if (p / "pyproject.toml").is_file())


def imported_modules(path: Path, typing_only: bool = True) -> set[str]:
    """Every absolute module a file imports, at any depth of the file (``from a.b import c`` gives a.b and
    a.b.c: c may be a submodule). ``typing_only=False`` leaves out the imports under ``if TYPE_CHECKING:``
    (annotations only: never executed, so they make no import cycle)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped: set[int] = set()
    if not typing_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def core_module(path: Path) -> str:
    parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def plugin_packages(plugin_dir: Path) -> set[str]:
    return {p.name for p in plugin_dir.iterdir() if p.is_dir() and p.name.startswith("omnirl_plugin_")}


def test_the_core_imports_no_plugin():
    offenders = {f"{core_module(p)} -> {m}" for p in CORE.rglob("*.py")
                 for m in imported_modules(p) if m.split(".")[0].startswith("omnirl_plugin_")}
    assert not offenders, sorted(offenders)


def test_no_plugin_imports_another_plugin():
    assert len(PLUGIN_DIRS) > 20
    offenders = []
    for plugin in PLUGIN_DIRS:
        own = plugin_packages(plugin)
        for path in plugin.rglob("*.py"):
            for m in imported_modules(path):
                top = m.split(".")[0]
                if top.startswith("omnirl_plugin_") and top not in own:
                    offenders.append(f"{path.relative_to(ROOT)} -> {top}")
    assert not offenders, sorted(set(offenders))


def test_the_core_import_graph_has_no_cycle():
    modules = {core_module(p): p for p in CORE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        # a module depends on the core modules it imports (a package __init__ it passes through does not
        # count unless named: `from omnirl_core.flow import sampler` is the sampler)
        graph[name] = {m for m in imported_modules(path, typing_only=False) if m in modules and m != name}
    for name, deps in list(graph.items()):  # "from omnirl_core.flow import x" names the package and x
        graph[name] = {m for m in deps if not (modules[m].name == "__init__.py" and
                                               any(o.startswith(m + ".") for o in deps))}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            assert cycle is None, " -> ".join(cycle)


# -- declared seams (CONTRIBUTING: "The contracts") ------------------------------------------------------------

RUNTIME_PACKAGES = ("loop", "rewards", "data", "serving", "host", "rundir")
MATH_PACKAGES = ("flow", "ar", "rl")

PROBE_ALLOWED = {
    # (module, the probed name): why it is duck typing of something that is not an omnirl component
    ("omnirl_core.rundir.pictures", "detach"): "an output is a torch tensor or a numpy array / PIL image",
    ("omnirl_core.rundir.pictures", "shape"): "an output is an image / video tensor or text",
    ("omnirl_core.flow.model", "unexpected_keys"): "peft's load result differs across peft versions",
    ("omnirl_core.weights", "base_layer"): "peft's LoRA layers (third-party modules)",
    ("omnirl_core.weights", "get_delta_weight"): "peft's LoRA layers (third-party modules)",
    ("omnirl_core.weights", "active_adapters"): "peft's LoRA layers (third-party modules)",
    ("omnirl_core.weights", "bias"): "a torch layer may have no bias attribute",
    ("omnirl_core.serving.envs", "_base_executable"): "a CPython detail absent on other interpreters",
    ("omnirl_core.serving.rollout_server", "type"): "a device given as a torch.device or a string",
    ("omnirl_core.rewards.dispatch", "register_at_fork"): "os.register_at_fork is POSIX only",
    ("omnirl_core.rewards.dispatch", "__iter__"): "checking what a reward returned (any iterable of numbers)",
    ("omnirl_core.config", "model_fields"): "pydantic model introspection for did-you-mean paths",
    ("omnirl_core.config", "__args__"): "typing introspection of a field's annotation",
    ("omnirl_core.plugins", "dist"): "importlib.metadata EntryPoint.dist is missing on Python 3.10's backport",
    ("omnirl_core.plugins", "__name__"): "a registered plugin may be a module or an object",
    ("omnirl_core.planning.activations", "enable_gradient_checkpointing"): "diffusers vs transformers modules",
    ("omnirl_core.rewards_kit.clip", "resample"): "transformers' image processors differ across versions",
    ("omnirl_core.rewards_kit.clip", "value"): "PIL's resampling enum vs an int across versions",
    ("omnirl_core.testing.forkserver", "fork"): "os.fork exists on POSIX only",
    ("omnirl_core.testing", "frames"): "a diffusers pipeline output holds images or video frames",
    ("omnirl_core.testing", "gradient_checkpointing"): "the suite reports a third-party module's flag",
    ("omnirl_core.ar.model", "name_or_path"): "a transformers module's config may lack a hub name",
    ("omnirl_core.ar.model", "unexpected_keys"): "peft's load result differs across peft versions",
    ("omnirl_core.manifest", "__path__"): "a registered plugin may be a module, a package or an object",
    ("omnirl_core.planning.activations", "name"): "transformers' model outputs hold optional fields",
    ("omnirl_core.resolve", "model_fields"): "a plugin's options class may be any pydantic model or none",
    ("omnirl_core.testing.engines", "to_local"): "a torch tensor may be a DTensor (FSDP2's shards)",
    ("omnirl_core.testing.engines", "full_tensor"): "a torch tensor may be a DTensor (FSDP2's shards)",
    ("omnirl_core.testing.engines", "detach"): "optimizer state holds tensors and plain numbers",
}


def probes(path: Path) -> set[str]:
    """Names a file probes for: ``hasattr(x, "name")`` and ``getattr(x, "name", default)`` (a literal name with a
    fallback asks whether the attribute exists; ``getattr(x, name)`` of a declared field does not)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        probe = (node.func.id == "hasattr" and len(node.args) == 2) or \
            (node.func.id == "getattr" and len(node.args) == 3)
        if probe:
            name = node.args[1]
            found.add(name.value if isinstance(name, ast.Constant) else ast.unparse(name))
    return found


def test_no_core_module_probes_a_components_optional_behaviour():
    offenders = sorted(f"{core_module(p)}: {name}" for p in CORE.rglob("*.py") for name in probes(p)
                       if (core_module(p), name) not in PROBE_ALLOWED)
    assert not offenders, "declare it in omnirl_core.contracts (or allow-list third-party duck typing): " \
        + ", ".join(offenders)
    stale = sorted(f"{m}: {n}" for m, n in PROBE_ALLOWED
                   if n not in probes(CORE.parent / (m.replace(".", "/") + ".py")
                                      if (CORE.parent / (m.replace(".", "/") + ".py")).is_file()
                                      else CORE.parent / m.replace(".", "/") / "__init__.py"))
    assert not stale, f"allow-listed probes that are gone: {stale}"


def test_the_math_packages_import_no_runtime_module():
    runtime = tuple(f"omnirl_core.{p}" for p in RUNTIME_PACKAGES)
    offenders = sorted({f"{core_module(p)} -> {m}" for pkg in MATH_PACKAGES for p in (CORE / pkg).rglob("*.py")
                        for m in imported_modules(p) if m.startswith(runtime)})
    assert not offenders, offenders


DEVICE_TYPES = {"cpu", "cuda", "npu"}
"""The device plugins' names are torch's device types, which the core uses as such."""
NAME_ALLOWED = {
    # (module, string): why the string is not a reference to the plugin of that name
    ("omnirl_core.config", "diffusers"): "the embedded default rollout engine: a config value a user can change",
    ("omnirl_core.config", "torch"): "the embedded default train engine: a config value a user can change",
    ("omnirl_core.host.quiet", "diffusers"): "the library's logger",
    ("omnirl_core.host.quiet", "transformers"): "the library's logger",
    ("omnirl_core.testing", "diffusers"): "the library, imported before a timing",
    ("omnirl_core.testing", "transformers"): "the library, imported before a timing",
    ("omnirl_core.testing.forkserver", "torch"): "the library, preloaded",
    ("omnirl_core.testing.forkserver", "diffusers"): "the library, preloaded",
    ("omnirl_core.testing.forkserver", "transformers"): "the library, preloaded",
    ("omnirl_core.loop.interrupts", "torch"): "the library, looked up in sys.modules",
    ("omnirl_core.host.threads", "torch"): "the library, found on disk (which OpenMP runtime it ships)",
    ("omnirl_core.data.builtin.make_sets", "color"): "a column of the colour prompt set",
    ("omnirl_core.planning.activations", "torch"): "the library's version, part of a cached trace's key",
    ("omnirl_core.planning.activations", "diffusers"): "the library's version, part of a cached trace's key",
    ("omnirl_core.planning.activations", "transformers"): "the library's version, part of a cached trace's key",
}


def first_party_component_names() -> set[str]:
    import tomllib

    names = set()
    for plugin in PLUGIN_DIRS:
        for manifest in plugin.glob("omnirl_plugin_*/omnirl.toml"):
            for entries in tomllib.loads(manifest.read_text()).values():
                for entry in entries if isinstance(entries, list) else []:
                    names.add(entry["name"])
                    names.update(entry.get("aliases", []))
    return names


def test_the_core_names_no_plugin():
    """No string literal in the core's code is a first-party component's name: what the core needs of a plugin
    comes from its spec (docstrings and comments may name examples)."""
    names = first_party_component_names()
    assert {"qwen-image", "flowgrpo", "fsdp2", "diffusers", "color"} <= names
    names -= DEVICE_TYPES
    offenders = []
    for path in CORE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                    and node.value in names and (core_module(path), node.value) not in NAME_ALLOWED:
                offenders.append(f"{core_module(path)}:{node.lineno}: {node.value!r}")
    assert not offenders, offenders
