"""Plugin manifests: a plugin's components declared as data in ``omnirl.toml`` beside its ``__init__.py``.

One array of tables per kind (``[[model]]``, ``[[algorithm]]``, ``[[engine]]``, ``[[reward]]``,
``[[device]]``, ``[[tracker]]``); every key is a field of that kind's spec (``omnirl_core.registry``), lists
become the field's tuple or frozenset. Code is named by ``"module:attr"`` strings, as in the specs: factories,
config classes, probes, ``limits`` functions. Two conveniences that TOML lacks:

- a defaults table (``recipe_defaults``, or a preset's table under ``preset_defaults``) may hold
  ``extends = "module:attr"``: the rest of the table is deep-merged over that dict
  (``extends = "omnirl_core.presets:TINY_IMAGE_DEFAULTS"``);
- a model's ``limits`` may be a table of ``ModelLimits`` fields, or one such table per preset, the key
  ``default`` standing for every other preset and the released checkpoints.

A manifest with a mistake raises ``PluginError`` naming the file, the table and the key: the plugin is then
broken, as when its hook raises. Registrations that must be computed stay hooks (``omnirl_core.hookspecs``).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from functools import cache
from importlib.resources import files
from typing import Any

from omnirl_core.errors import PluginError, did_you_mean
from omnirl_core.hookspecs import KINDS
from omnirl_core.registry import SPEC_FOR_KIND, ComponentSpec, ModelLimits, load_object

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MANIFEST = "omnirl.toml"
FILLED_IN = {"plugin": "the plugin's name", "first_party": "where the plugin was installed from"}
"""Spec fields the registry sets; a manifest that names them is refused."""
AS_DATA: dict[str, Any] = {
    "factory": str, "config": str, "sizing": str,
    "default_prompts": str | list[str], "input_fields": str | tuple[str, ...], "limits": str | dict[str, Any],
}
"""The TOML form of the spec fields that hold code or data: "module:attr" strings, or data (``limits``: below)."""
DEFAULTS_TABLES = ("recipe_defaults", "preset_defaults")
EXTENDS = 'Name a dict as "module:attr", e.g. extends = "omnirl_core.presets:TINY_IMAGE_DEFAULTS".'


def manifest_specs(plugin: object, plugin_name: str) -> list[ComponentSpec]:
    """The specs declared by the manifest of a package plugin (none when it has no ``omnirl.toml``)."""
    if not isinstance(plugin, types.ModuleType) or not hasattr(plugin, "__path__"):
        return []  # a plain module or an object: only a package has a file beside its __init__.py
    path = files(plugin) / MANIFEST
    if not path.is_file():
        return []
    return parse_manifest(path.read_text(encoding="utf-8"), plugin_name, str(path))


def parse_manifest(text: str, plugin_name: str, source: str) -> list[ComponentSpec]:
    where = f"Plugin '{plugin_name}', {source}"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PluginError(f"{where}: not valid TOML: {exc}.", hint="See https://toml.io.") from exc
    specs = []
    for kind, tables in data.items():
        if kind not in KINDS:
            raise PluginError(f"{where}: unknown component kind [[{kind}]].{did_you_mean(kind, KINDS)}",
                              hint=f"Declare components in arrays of tables named by kind: "
                                   f"{', '.join(f'[[{k}]]' for k in KINDS)}.")
        if not isinstance(tables, list):
            raise PluginError(f"{where}: '{kind}' must be an array of tables.",
                              hint=f"Write [[{kind}]] (two brackets) above each {kind}'s keys.")
        for index, table in enumerate(tables):
            specs.append(_spec(SPEC_FOR_KIND[kind], table, f"{where}, [[{kind}]] #{index + 1}"))
    return specs


def _spec(cls: type[ComponentSpec], table: dict[str, Any], where: str) -> ComponentSpec:
    if isinstance(table.get("name"), str):
        where += f" ('{table['name']}')"
    hints = _field_types(cls)  # type: ignore[arg-type, unused-ignore]  # mypy: a dataclass class is hashable
    for key in table:
        if key in FILLED_IN:
            raise PluginError(f"{where}: '{key}' is set by the registry ({FILLED_IN[key]}).",
                              hint=f"Remove '{key}'.")
        if key not in hints:
            raise PluginError(f"{where}: unknown key '{key}'.{did_you_mean(key, hints)}",
                              hint=f"A {cls.kind} declares: {', '.join(hints)}.")
    for key in ("name", "factory"):
        if key not in table:
            raise PluginError(f"{where}: the key '{key}' is missing.",
                              hint=f"Every component has a name and a factory (\"module:attr\"); a "
                                   f"{cls.kind} declares: {', '.join(hints)}.")
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key in DEFAULTS_TABLES and isinstance(value, dict):
            value = _extended(value, f"{where}, '{key}'", nested=key == "preset_defaults")
        if key == "limits" and isinstance(value, dict):
            values[key] = _limits(value, f"{where}, 'limits'")
        else:
            values[key] = _convert(value, AS_DATA.get(key, hints[key]), f"{where}: '{key}'")
    return cls(**values)


@cache
def _field_types(cls: type[ComponentSpec]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in FILLED_IN}


def _extended(table: dict[str, Any], where: str, nested: bool) -> dict[str, Any]:
    """A defaults table with ``extends`` resolved (in each preset's table when ``nested``)."""
    if nested:
        return {k: _extended(v, f"{where}, '{k}'", nested=False) if isinstance(v, dict) else v
                for k, v in table.items()}
    if "extends" not in table:
        return table
    from omnirl_core.config import deep_merge

    rest = {k: v for k, v in table.items() if k != "extends"}
    ref = table["extends"]
    try:
        base = load_object(ref) if isinstance(ref, str) else None
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"{where}: 'extends' = '{ref}' does not load: {exc}.", hint=EXTENDS) from exc
    if not isinstance(base, dict):
        raise PluginError(f"{where}: 'extends' must name a dict (got {ref!r}).", hint=EXTENDS)
    return deep_merge(base, rest)


def _limits(table: dict[str, Any], where: str) -> ModelLimits | dict[str | None, ModelLimits]:
    """One ``ModelLimits``, or one per preset when every value is a table (``default``: any other preset)."""
    if table and all(isinstance(v, dict) for v in table.values()):
        return {None if preset == "default" else preset: _limits_of(v, f"{where}, '{preset}'")
                for preset, v in table.items()}
    return _limits_of(table, where)


def _limits_of(table: dict[str, Any], where: str) -> ModelLimits:
    hints = _field_types(ModelLimits)
    for key in table:
        if key not in hints:
            raise PluginError(f"{where}: unknown key '{key}'.{did_you_mean(key, hints)}",
                              hint=f"Limits declare {', '.join(hints)}; or a table of them per preset.")
    return ModelLimits(**{k: _convert(v, hints[k], f"{where}: '{k}'") for k, v in table.items()})


class _Mismatch(Exception):
    pass


def _convert(value: object, hint: Any, where: str) -> Any:
    try:
        return _as(value, hint)
    except _Mismatch:
        raise PluginError(f"{where} must be {_describe(hint)}, not {_toml_type(value)} ({value!r}).",
                          hint="Write it as the spec's field expects (see omnirl_core.registry).") from None


def _as(value: object, hint: Any) -> Any:
    """``value`` as the annotation ``hint`` wants it (lists to tuples and frozensets), or ``_Mismatch``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return _as(value, option)
            except _Mismatch:
                pass
        raise _Mismatch
    if hint is type(None):
        raise _Mismatch  # TOML has no null
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (str, bool, int, float):
        if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
            return value
        raise _Mismatch
    if origin in (tuple, frozenset, list):
        if not isinstance(value, list):
            raise _Mismatch
        return origin(_as(item, args[0]) for item in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        return {k: _as(v, args[1]) for k, v in value.items()}
    raise _Mismatch  # pragma: no cover - a spec field type this loader does not know


def _describe(hint: Any, plural: bool = False) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a, plural) for a in args if a is not type(None))
    if origin in (tuple, frozenset, list):
        return f"{'arrays' if plural else 'an array'} of {_describe(args[0], plural=True)}"
    if origin is dict and args[1] is not Any:
        return f"{'tables' if plural else 'a table'} of {_describe(args[1], plural=True)}"
    names = {str: ("a string", "strings"), bool: ("a boolean", "booleans"), int: ("an integer", "integers"),
             float: ("a number", "numbers"), dict: ("a table", "tables")}
    return names.get(origin or hint, (str(hint), str(hint)))[plural]


def _toml_type(value: object) -> str:
    for python, name in ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
                         (list, "an array"), (dict, "a table")):
        if isinstance(value, python):
            return name
    return f"a {type(value).__name__}"
