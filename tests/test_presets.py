"""Every default of a preset field lives in its table: engine/presets.py (classification, one
column per device) and engine/retrieval/presets.py (retrieval); no other module holds a literal
copy that could drift from it."""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from engine import presets
from engine.retrieval import presets as retrieval

REPO = Path(__file__).resolve().parent.parent
TABLES = {"engine/presets.py": presets.Preset, "engine/retrieval/presets.py": retrieval.RetrievalPreset}
SCANNED = ("engine", "evaluator")


def watched_names() -> dict[str, str]:
    """name or Owner.name -> the table field it stands for: every field of both tables by its own
    name, and by each name in its `names` metadata (what other code calls it)."""
    out: dict[str, str] = {}
    for table in TABLES.values():
        for f in dataclasses.fields(table):
            for name in (f.name, *f.metadata.get("names", ())):
                out[name] = f"{table.__name__}.{f.name}"
    return out


def _numeric(node: ast.AST) -> bool:
    """A number literal (a sign allowed), or a tuple / list of them; True and False are not numbers."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    if isinstance(node, (ast.Tuple, ast.List)):
        return bool(node.elts) and all(_numeric(e) for e in node.elts)
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def _dest(call: ast.Call) -> str | None:
    """The attribute an add_argument call fills: dest=, else its first long flag, else its first name."""
    for k in call.keywords:
        if k.arg == "dest" and isinstance(k.value, ast.Constant):
            return k.value.value
    flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    long = [f for f in flags if f.startswith("--")]
    name = (long or flags or [None])[0]
    return name.lstrip("-").replace("-", "_") if name else None


def numeric_defaults(tree: ast.AST):
    """(owner, name, line, literal) of every numeric literal default in `tree`: dataclass-style
    field defaults (`name: T = 3`, `name: T = field(default=3)`), function parameter defaults
    (positional and keyword-only) and argparse `add_argument(..., default=3)`. The owner is the
    class of a field or a method, else the function; None for module level."""
    def visit(node, owner):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                for s in child.body:
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None:
                        v = s.value
                        if isinstance(v, ast.Call) and getattr(v.func, "attr", getattr(v.func, "id", "")) == "field":
                            v = next((k.value for k in v.keywords if k.arg == "default"), None)
                        if v is not None and _numeric(v):
                            yield child.name, s.target.id, s.lineno, ast.unparse(v)
                yield from visit(child, child.name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                here = owner if owner and child.name == "__init__" else child.name
                a = child.args
                positional = a.posonlyargs + a.args
                pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
                pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                for arg, d in pairs:
                    if _numeric(d):
                        yield here, arg.arg, d.lineno, ast.unparse(d)
                yield from visit(child, here)
            else:
                if isinstance(child, ast.Call) and getattr(child.func, "attr", "") == "add_argument":
                    for k in child.keywords:
                        if k.arg == "default" and _numeric(k.value):
                            yield owner, _dest(child), child.lineno, ast.unparse(k.value)
                yield from visit(child, owner)

    yield from visit(tree, None)


def literal_copies(root: Path = REPO) -> list[str]:
    watched = watched_names()
    found = []
    for pkg in SCANNED:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in TABLES:
                continue
            for owner, name, line, literal in numeric_defaults(ast.parse(path.read_text(), rel)):
                field = watched.get(f"{owner}.{name}") or watched.get(name)
                if field:
                    found.append(f"{rel}:{line}: {owner or '<module>'}.{name} = {literal} (a copy of {field})")
    return found


def test_no_numeric_default_of_a_preset_field_is_written_outside_its_table():
    """Fails when a numeric literal default for a field of either table appears in engine/ or
    evaluator/ outside the two table modules.

    Fields: every field of engine.presets.Preset and of engine.retrieval.presets.RetrievalPreset,
    each under its own name and under every name its `names` metadata lists (a bare name
    anywhere, e.g. SearchConfig's `budget_s` for `search_budget_s`; `Owner.name` only in that
    class or function, e.g. `GuardConfig.budget` for `guard_budget`, `Pic2WordConfig.hidden` for
    `p2w_hidden`).

    Forms (the numeric literals: int and float constants, negated or not, and tuples or lists of
    them; True/False are not numbers): a class-body annotated default (`name: T = 3` or
    `name: T = field(default=3)`, i.e. dataclass fields), a function parameter default
    (positional or keyword-only; a method's owner is its class), and argparse's
    `add_argument(..., default=3)` whose dest (dest=, else the first long flag) is the name.
    A default written as a reference to the table (`RETRIEVAL.dba_alpha`, `preset(d).guard_budget`)
    or a name (`TOP_K`) is not a literal and passes; so does a literal under a name no table holds.
    """
    found = literal_copies()
    assert not found, "numeric defaults of preset fields outside the tables:\n" + "\n".join(found)


def test_the_scan_finds_each_form_it_checks(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "evaluator").mkdir()
    (tmp_path / "engine" / "m.py").write_text(
        "import dataclasses\n"
        "@dataclasses.dataclass\n"
        "class SearchConfig:\n"
        "    budget_s: float = 900.0\n"
        "    dba_alpha: float = dataclasses.field(default=3.0)\n"
        "class GuardConfig:\n"
        "    budget: float = 10.0\n"
        "def photo_pixels(spec, count=256, *, chunk_size=-1):\n"
        "    pass\n"
        "def other(count=256, budget=10.0):\n"      # names watched only in their owner: not copies
        "    pass\n")
    (tmp_path / "evaluator" / "cli.py").write_text(
        "def main(p):\n"
        "    p.add_argument('--p2w-hidden', type=int, default=512)\n"
        "    p.add_argument('--size', dest='batch_size', default=(8, 16))\n"
        "    p.add_argument('--gap-shift', default=RETRIEVAL.gap_shift)\n")   # a reference: not a copy
    found = literal_copies(tmp_path)
    assert [f.split(": ", 1)[1] for f in found] == [
        "SearchConfig.budget_s = 900.0 (a copy of Preset.search_budget_s)",
        "SearchConfig.dba_alpha = 3.0 (a copy of RetrievalPreset.dba_alpha)",
        "GuardConfig.budget = 10.0 (a copy of Preset.guard_budget)",
        "photo_pixels.count = 256 (a copy of Preset.calibration_count)",
        "photo_pixels.chunk_size = -1 (a copy of RetrievalPreset.chunk_size)",
        "main.p2w_hidden = 512 (a copy of RetrievalPreset.p2w_hidden)",
        "main.batch_size = (8, 16) (a copy of Preset.batch_size)",
    ], found


def test_every_field_says_what_it_means():
    for table in TABLES.values():
        for f in dataclasses.fields(table):
            if f.name != "device":
                assert f.metadata.get("doc", "").strip(), f"{table.__name__}.{f.name} has no doc"


@pytest.mark.abi
def test_python_m_engine_presets_prints_both_tables():
    r = subprocess.run([sys.executable, "-m", "engine.presets"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    classification, retrieval_table = r.stdout.strip().split("\n\n")
    assert classification == presets.markdown() and retrieval_table == retrieval.markdown()
    assert "| `guard_budget` | 10.0 | 10.0 |" in classification
    assert "| `dba_alpha` | 3.0 |" in retrieval_table and "| `image_batch` | cpu: 64, cuda: 256 |" in retrieval_table


def test_the_build_help_says_what_each_option_does_and_prints_the_presets_values():
    from engine.build import argument_parser

    p = argument_parser()
    text = " ".join(p.format_help().split())          # argparse wraps long help lines
    for field in ("precision", "backend", "batch_size", "search_budget_s", "build_deadline_s", "recheck_batch",
                  "guard_budget", "guard_safety", "calibration_count"):
        assert presets.per_device(field) in text, field
    for action in p._actions:
        assert (action.help or "").strip(), f"{action.option_strings} has no help"


def test_the_defaults_compose_quotes_in_prose_are_the_tables():
    """engine.retrieval.compose's docstring shows each option with its default (`aqe[:n=3:alpha=3]`)
    and Slerp's text weights: every number it quotes is the value a method built from that name gets."""
    import re

    from engine.retrieval import compose
    from engine.retrieval.options import named

    doc = compose.__doc__
    checked = set()
    for opt, brackets in re.findall(r"`([a-z-]+)((?:\[:[^\]`]*\])+)`", doc):
        if opt not in named():          # `option[:key=value...]`: the syntax itself
            continue
        method = compose.make_method(f"slerp+{opt}")
        for pair in re.findall(r"[a-z]+=[^:\]]+", brackets):
            key, value = pair.split("=")
            if re.fullmatch(r"[0-9.]+", value):
                got = getattr(method.option(opt), named()[opt].keys[key].attr)
                assert float(got) == float(value), f"compose's docstring says {opt}:{key}={value}; the default is {got}"
                checked.add((opt, key))
    assert checked >= {("isoftmax", "beta"), ("qbnorm", "beta"), ("dual-softmax", "temp"), ("csls", "k"),
                       ("aqe", "n"), ("aqe", "alpha"), ("dba", "n"), ("dba", "alpha"), ("reinspect", "n"),
                       ("reinspect", "crops")}, checked
    weights = re.search(r"text\s+weight ([0-9.]+) for requests with a shared_concept[^.]*?and ([0-9.]+) otherwise",
                        doc)
    assert weights and tuple(map(float, weights.groups())) == tuple(compose.DEFAULT_WEIGHTS["slerp"])
