"""Follow one argument through the code: which modules a reader visits, and how often they come back.

    python3 scripts/walk.py --follow VALUE [--json FILE] -- MODULE [ARG ...]

Runs `python -m MODULE ARG ...` in this process under a profiler that records the tree of calls of
project functions (engine/, evaluator/, kernels/, scripts/). A call carries VALUE when a parameter
holds it at the call, or any local at its return (the function that parsed or built it): held means
VALUE itself, a str or path containing it, or a container, dataclass, namespace, object, closure or
partial holding one, two levels deep. VALUE should be a distinctive string the command is given,
e.g. an output path.

The walk is what a reader following VALUE reads, in call order: the carrying calls, the first call
of each function only (a loop over images is read once). A call appends its module; its return
appends the module of the nearest carrying caller (the reader goes back there); a call that does not
carry the value is passed through. Consecutive entries of one module are one stay.

Counts: places (distinct modules), stays, returns (stays entered by a return into another module),
climbs (calls into a higher layer than the carrying caller's: LAYERS below, higher = nearer the
entry point). Child processes are not followed; the command's exit status is printed, not raised.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import runpy
import sys
import threading
from pathlib import Path, PurePath

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("engine", "evaluator", "kernels", "scripts")
DEPTH = 2   # how deep a parameter's containers are searched for the value

# Layers, lowest first (engine/__init__.py's table, then the evaluator and the scripts above it): a
# module's layer is the longest prefix listed here (the walk's climbs).
LAYERS = (
    ("kernels",),
    ("engine.children", "engine.cli", "engine.io", "engine.memory", "engine.process_stats",
     "engine.progress", "engine.settings", "engine.stdio", "engine.threads"),
    ("engine.presets",),
    ("engine.core",),
    ("engine.decoders", "engine.backends"),
    ("engine.classify",),
    ("engine.build", "engine.tuning", "engine.clip"),
    ("engine.retrieval",),
    ("engine",),
    ("evaluator",),
    ("scripts", "__main__"),
)


def layer(module: str) -> int:
    """The layer of a dotted module name (the longest listed prefix; unknown modules sit on top)."""
    best, rank = -1, len(LAYERS)
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, rank = len(name), i
    return rank


def module_of(filename: str) -> str | None:
    """The dotted module of a project file, or None for a file outside the project's code."""
    try:
        rel = Path(filename).resolve().relative_to(REPO)
    except ValueError:
        return None
    if not rel.parts or rel.parts[0] not in ROOTS or rel.suffix != ".py":
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def carries(value, needle: str, depth: int = DEPTH) -> bool:
    """Whether `value` is, contains or holds the followed string."""
    if isinstance(value, (str, PurePath)):
        return needle in str(value)
    if depth == 0 or value is None or isinstance(value, (int, float, bool, bytes)):
        return False
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)[:64]   # shapes: argv lists and small records, not image batches
    elif isinstance(value, functools.partial):
        items = [value.func, *value.args, *value.keywords.values()]
    elif callable(value) and getattr(value, "__closure__", None):   # a closure made around the value
        items = []
        for cell in value.__closure__:
            try:
                items.append(cell.cell_contents)
            except ValueError:   # a cell not filled yet
                pass
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    elif hasattr(value, "__dict__") and not isinstance(value, type) and type(value).__module__ != "builtins":
        try:
            items = list(vars(value).values())[:64]
        except TypeError:
            return False
    else:
        return False
    return any(carries(v, needle, depth - 1) for v in items)


@dataclasses.dataclass
class Node:
    """One call of a project function: whether it carried the value, and the calls it made."""
    module: str
    function: str
    code: object
    carried: bool
    children: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Walk:
    """The walk: modules in reading order ("call" or "return" each) and the functions read."""
    sequence: list[str] = dataclasses.field(default_factory=list)
    kinds: list[str] = dataclasses.field(default_factory=list)
    calls: list[dict] = dataclasses.field(default_factory=list)
    climbs: int = 0

    def counts(self) -> dict:
        stays, returns, last, seen = 0, 0, None, []
        for module, kind in zip(self.sequence, self.kinds):
            if module == last:
                continue
            stays += 1
            returns += kind == "return"
            last = module
            if module not in seen:
                seen.append(module)
        return {"places": len(seen), "stays": stays, "returns": returns, "climbs": self.climbs, "modules": seen}


def read(roots: list[Node]) -> Walk:
    """The reader's walk over the call tree: carried calls, first of each function, in call order.

    A call that did not carry the value, or a later call of a function already read, is passed
    through: the calls it made are read as if its caller made them."""
    walk, seen = Walk(), set()

    def visit(node: Node, reader: Node | None) -> None:
        if node.carried and node.code not in seen:
            seen.add(node.code)
            if reader is not None and layer(node.module) > layer(reader.module):
                walk.climbs += 1
            walk.sequence.append(node.module)
            walk.kinds.append("call")
            walk.calls.append({"module": node.module, "function": node.function,
                               "caller": reader.module if reader else None})
            for child in node.children:
                visit(child, node)
            if reader is not None:
                walk.sequence.append(reader.module)
                walk.kinds.append("return")
        else:
            for child in node.children:
                visit(child, reader)

    for root in roots:
        visit(root, None)
    return walk


class Tracer:
    """The profiler: the tree of project calls, each marked whether it carried the needle (a
    parameter at the call, or any local at its return: a function that parsed or built it)."""

    def __init__(self, needle: str):
        self.needle = needle
        self.roots: list[Node] = []
        self.live: dict[int, Node] = {}    # id(frame) -> its node, while the frame runs
        self.lock = threading.Lock()

    def _parent(self, frame) -> Node | None:
        f = frame.f_back
        while f is not None:
            node = self.live.get(id(f))
            if node is not None:
                return node
            f = f.f_back
        return None

    def __call__(self, frame, event, arg):
        if event == "return":
            node = self.live.pop(id(frame), None)
            if node is not None and not node.carried:
                node.carried = any(carries(v, self.needle) for v in list(frame.f_locals.values()))
            return
        if event != "call":
            return
        code = frame.f_code
        module = module_of(code.co_filename)
        if module is None or code.co_name.startswith("<"):   # comprehensions and lambdas read with their owner
            return
        params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount
                                  + bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)]
        carried = any(carries(frame.f_locals.get(p), self.needle) for p in params)
        node = Node(module, code.co_qualname, code, carried)
        parent = self._parent(frame)
        with self.lock:
            (parent.children if parent is not None else self.roots).append(node)
        self.live[id(frame)] = node


def run(needle: str, module: str, args: list[str]) -> tuple[Walk, int]:
    """Run `python -m module args` under the tracer; the walk and the exit status."""
    tracer = Tracer(needle)
    old_argv = sys.argv
    sys.argv = [module, *args]
    status = 0
    threading.setprofile(tracer)
    sys.setprofile(tracer)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        sys.argv = old_argv
    return read(tracer.roots), status


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="walk", description=__doc__.split("\n\n")[0])
    ap.add_argument("--follow", required=True, help="the distinctive string to follow (e.g. an output path)")
    ap.add_argument("--json", type=Path, help="write the walk here as JSON (default: none, the counts on stderr only)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- MODULE [ARG ...]")
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command: give -- MODULE [ARG ...]")
    if not a.follow.strip():
        ap.error("--follow: an empty string is carried by every argument; give a distinctive one")
    sys.path.insert(0, str(REPO))
    walk, status = run(a.follow, cmd[0], cmd[1:])
    counts = walk.counts()
    line = (f"walk: {counts['places']} places, {counts['stays']} stays, {counts['returns']} returns, "
            f"{counts['climbs']} climbs (exit {status})")
    print(" -> ".join(counts["modules"]), file=sys.stderr)
    print(line, file=sys.stderr)
    if a.json:
        a.json.write_text(json.dumps({"command": cmd, "follow": a.follow, "exit": status, **counts,
                                      "sequence": walk.sequence, "calls": walk.calls}, indent=1) + "\n")
    return 0 if status == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main(sys.argv[1:]))
