"""Retrieval options are one file each behind one table (engine/retrieval/options/): a new option is
its file and its line in `OPTIONS`, and runs through scripts/build.sh and scripts/run.sh with
nothing else edited; each option's keys round-trip through a method name and the flat record;
and no function of engine/retrieval takes more than 7 parameters (one settings object instead)."""
from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from tests.cir_helpers import REPO, build_args, built_index, corpus, full_run, read_rows, script

MAX_PARAMETERS = 7
# folders held to MAX_PARAMETERS, each with its own state objects
CHECKED_FOLDERS = ("engine/retrieval", "engine/tuning")


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters of a def: self / cls not counted, *args and **kwargs one each."""
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len(names) - (names[:1] in (["self"], ["cls"])) + (a.vararg is not None) + (a.kwarg is not None)


def test_parameter_count_reads_defs_as_the_rule_says():
    tree = ast.parse("def f(self, a, b, *c, d, **e): pass\ndef g(cls): pass\ndef h(a, /, b=1): pass")
    assert [_parameters(f) for f in tree.body] == [5, 0, 2]


@pytest.mark.parametrize("folder", CHECKED_FOLDERS)
def test_no_function_takes_more_than_seven_parameters(folder):
    """A long argument list handed from function to function is one settings object instead
    (gallery.BuildJob, query.QuerySettings, search.SearchSettings, ...; the classification build's
    context.BuildContext, calibrate.TauRule, calibration_trade.Trade, reference.Window)."""
    over = []
    for path in sorted((REPO / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _parameters(node) > MAX_PARAMETERS:
                over.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({_parameters(node)})")
    assert not over, f"more than {MAX_PARAMETERS} parameters: {over}"


def test_every_option_round_trips_its_keys_through_a_name_and_the_record():
    """Each option of the table: its keys parse from a method name with non-default values, the
    label gives the same name back, and the flat record (meta.json `method`) gives the same method."""
    from engine.retrieval.compose import Method, make_method
    from engine.retrieval.options import OPTIONS, named

    assert set(named()) == set(OPTIONS) - {"pic2word"}       # the mapping comes with its base
    for name, cls in named().items():
        pairs = []
        for key, spec in cls.keys.items():
            if spec.kind is str:
                continue
            value = spec.default + 1 if spec.kind is int else spec.default / 2
            pairs.append(f"{key}={value:g}" if spec.kind is float else f"{key}={value}")
        label = "+".join(["slerp", ":".join([name, *pairs])])
        m = make_method(label)
        assert m.label == label and [o.name for o in m.options] == [name]
        assert Method.from_dict(m.to_dict()) == m
    assert make_method("pic2word").steps == (OPTIONS["pic2word"](),)


def test_the_build_asks_the_options_for_its_mapping_choices_and_extras():
    """--mapping offers the trained options; the index's optional files are the options' own."""
    from engine.retrieval.index import EXTRA_FILES
    from engine.retrieval.options import OPTIONS
    from evaluator.cir import build as cir_build

    trained = [n for n, cls in OPTIONS.items() if cls.trained]
    assert trained == ["pic2word"]
    cfg = cir_build.parse_args(["--corpus", "c", "--index-dir", "i", "--mapping", "pic2word"])
    assert cfg.mapping == "pic2word"
    assert set(EXTRA_FILES) == {f for cls in OPTIONS.values() for f in cls.extra_files}


PLANTED = '''"""A pass-through option: trained at build time (it stores a marker), rescores by leaving the list as it is."""
from __future__ import annotations

from engine.retrieval.options.base import Key, Option


class PassThrough(Option):
    name = "passthrough"
    source = "this kit's variant: a pass-through (test)"
    keys = {"n": Key("n", 1, int)}
    trained = True

    def validate(self) -> None:
        if self.n < 1:
            raise ValueError("passthrough n must be >= 1")

    def record(self) -> dict:
        return {}

    def rescore(self, space, batch, scored, vals, idx):
        space.info["passthrough_rows"] = space.info.get("passthrough_rows", 0) + len(batch)
        return vals, idx

    @classmethod
    def extras(cls, ctx):
        return ({"passthrough": {"rows": len(ctx.rows)}}, {}) if ctx.cfg.mapping == cls.name else ({}, {})
'''


def _plant(root: Path) -> None:
    """A copy of the code with one more option: its file and its line in the table."""
    for part in ("engine", "evaluator", "kernels", "scripts"):
        shutil.copytree(REPO / part, root / part, ignore=shutil.ignore_patterns("__pycache__"), symlinks=True)
    (root / "engine/retrieval/options/passthrough.py").write_text(PLANTED)
    table = root / "engine/retrieval/options/__init__.py"
    text = table.read_text()
    text = text.replace("from engine.retrieval.options.base import", "from engine.retrieval.options.passthrough import "
                        "PassThrough\nfrom engine.retrieval.options.base import", 1)
    assert "    Reinspect,\n)}" in text
    table.write_text(text.replace("    Reinspect,\n)}", "    Reinspect,\n    PassThrough,\n)}", 1))


@pytest.mark.abi
def test_a_planted_option_runs_through_build_and_run_sh(tmp_path):
    """One new file and one table line: scripts/build.sh offers and runs its build step
    (`--mapping passthrough` stores its marker: on a copy of the session's index, whose embeddings
    are kept), scripts/run.sh accepts `slerp+passthrough:n=2`, runs its rescore hook on every
    request and, as it passes the lists through, writes exactly the rows of `slerp`."""
    root = tmp_path / "kit"
    _plant(root)
    index = tmp_path / "index"
    shutil.copytree(built_index(), index)
    r = script("build.sh", *build_args(index, "--mapping", "passthrough"), env={"PYTHONPATH": str(root)}, root=root)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "recomputing the extras only" in r.stderr
    assert json.loads((index / "meta.json").read_text())["passthrough"]["rows"] > 0
    out, rep = tmp_path / "planted.jsonl", tmp_path / "planted.report.json"
    r = script("run.sh", "--index-dir", str(index), "--queries", str(corpus() / "requests.jsonl"),
               "--output", str(out), "--method", "slerp+passthrough:n=2", "--report", str(rep),
               env={"PYTHONPATH": str(root)}, root=root)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(rep.read_text())
    plain = full_run()                          # scripts/run.sh of this checkout: the index's method, slerp
    assert report["method_label"] == "slerp+passthrough:n=2"
    assert report["passthrough_rows"] == len(read_rows(plain)) > 0
    assert out.read_bytes() == plain.read_bytes()
