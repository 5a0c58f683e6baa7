"""A command's flags made from its config dataclass: one field, one flag, so a setting is
written once (its name, type, default and help) and the parser cannot drift from the config.

    @dataclass
    class BuildConfig:
        chunk_size: int = flag("images per resumable chunk", RETRIEVAL.chunk_size)

    add_flags(parser, BuildConfig, {"extras": parser.add_argument_group("extras")})

The flag is `--` + the field's name with dashes, its dest the field's name, its type the
field's annotation (int, float, Path; str and `X | None` as X), its default the field's, its
help the doc. A bool field is a switch (store_true). An int or float field must give its
`span=(lo, hi)` and `unit` (engine.cli.whole_number / finite_float: nan, inf, out of range
and garbage end in argparse's one line; `lo_open` excludes lo); `parse` replaces the type (a
validator such as engine.cli.device_name). `env` names a function read at parse
time whose value, when not None, replaces the field's default (e.g. CIR_METHOD). A field made
with `cli=False` is a setting of the config that no flag sets.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

_TYPES = {"int": int, "float": float, "Path": Path, "str": None, "bool": bool}


def flag(doc: str, default=dataclasses.MISSING, *, choices: tuple | None = None, group: str | None = None,
         env: Callable[[], object] | None = None, metavar: str | None = None, cli: bool = True,
         span: tuple[float, float] | None = None, unit: str = "", lo_open: bool = False,
         parse: Callable[[str], object] | None = None):
    """A config field and its flag; no default: a required flag (and a required field). `span`:
    the (lo, hi) an int or float flag accepts, in `unit`."""
    meta = {"doc": doc, "choices": choices, "group": group, "env": env, "metavar": metavar, "cli": cli,
            "span": span, "unit": unit, "lo_open": lo_open, "parse": parse}
    return dataclasses.field(default=default, metadata=meta)


def _ranged(name: str, kind: type, meta) -> Callable[[str], object]:
    """The argparse type of an int or float field: its span, checked (a field without one is refused)."""
    from engine.cli import finite_float, whole_number

    if meta.get("span") is None:
        raise TypeError(f"{name}: an {kind.__name__} flag needs span=(lo, hi)")
    lo, hi = meta["span"]
    if kind is int:
        return whole_number(lo, hi, meta["unit"])
    return finite_float(lo, hi, meta["unit"], lo_open=meta["lo_open"])


def _type(annotation) -> type | None:
    """int | float | Path | bool | None (str) from an annotation such as "int | None"."""
    names = [t.strip() for t in str(annotation).split("|") if t.strip() != "None"]
    if len(names) != 1 or names[0] not in _TYPES:
        raise TypeError(f"no flag type for the annotation {annotation!r}")
    return _TYPES[names[0]]


def add_flags(p: argparse.ArgumentParser, config: type, groups: dict | None = None) -> None:
    """One flag per field of the dataclass `config` made with `flag()` (fields without cli are left out),
    into `p` or the argument group its `group` names in `groups`."""
    for f in dataclasses.fields(config):
        meta = f.metadata
        if "doc" not in meta or not meta["cli"]:
            continue
        where = (groups or {})[meta["group"]] if meta["group"] else p
        name = "--" + f.name.replace("_", "-")
        kind = _type(f.type)
        kw: dict = {"dest": f.name, "help": meta["doc"]}
        if kind is bool:
            where.add_argument(name, action="store_true", **kw)
            continue
        if f.default is dataclasses.MISSING:
            kw["required"] = True
        else:
            from_env = meta["env"]() if meta["env"] else None
            kw["default"] = f.default if from_env is None else from_env
        for key in ("choices", "metavar"):
            if meta[key] is not None:
                kw[key] = meta[key]
        if meta.get("parse") is not None:
            kind = meta["parse"]
        elif kind in (int, float):
            kind = _ranged(name, kind, meta)
        where.add_argument(name, **({"type": kind} if kind else {}), **kw)
