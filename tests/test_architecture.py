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


def imported_modules(path: Path) -> set[str]:
    """Every absolute module a file imports, at any depth of the file (``from a.b import c`` gives a.b and
    a.b.c: c may be a submodule)."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
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
        graph[name] = {m for m in imported_modules(path) if m in modules and m != name}
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
