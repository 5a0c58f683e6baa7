"""The mutation-testing command (scripts/mutate.py) on a tiny module of its own: it finds the
mutants, kills those the tests catch, reports the ones they miss with their diff, counts the
reviewed equivalent ones apart, and runs the planted bugs (saying when one no longer applies)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mutate():
    spec = importlib.util.spec_from_file_location("mutate_tool", REPO / "scripts" / "mutate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mutate_tool"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("mutate_tool", None)


RULES = '''\
def passes(matches, rows):
    """The gate: at least 99 % of at least one row."""
    return rows > 0 and matches * 100 >= 99 * rows
'''

# Catches everything but the boundary: 99 of 100 is never tried, so `>=` -> `>` survives.
TESTS = '''\
from rules import passes


def test_gate():
    assert passes(100, 100)
    assert not passes(50, 100)
    assert not passes(0, 0)
    assert not passes(1, 0)
'''


FEW = ("compare", "operand")  # three mutants: the runs stay short


@pytest.fixture
def project(tmp_path):
    (tmp_path / "rules.py").write_text(RULES)
    (tmp_path / "test_rules.py").write_text(TESTS)
    return tmp_path


def test_finds_the_operators_sites(mutate, project):
    ops = {(m.operator, m.before, m.after) for m in mutate.mutants_of(project / "rules.py", "rules.py")}
    assert ("compare", "matches * 100 >= 99 * rows", "(matches * 100 > 99 * rows)") in ops
    assert ("compare", "rows > 0", "(rows >= 0)") in ops
    assert ("boolean", "rows > 0 and matches * 100 >= 99 * rows", "(rows > 0 or matches * 100 >= 99 * rows)") in ops
    assert ("constant", "100", "(101)") in ops and ("constant", "99", "(98)") in ops
    assert ("arithmetic", "matches * 100", "(matches / 100)") in ops
    assert ("return", "rows > 0 and matches * 100 >= 99 * rows",
            "(not (rows > 0 and matches * 100 >= 99 * rows))") in ops
    # a docstring is never mutated, and every mutant compiles
    assert not any("gate" in m.before for m in mutate.mutants_of(project / "rules.py", "rules.py"))


def test_a_pragma_line_is_skipped(mutate, project):
    (project / "rules.py").write_text(RULES.replace("* rows\n", "* rows  # pragma: no mutate\n"))
    assert mutate.mutants_of(project / "rules.py", "rules.py") == []


@pytest.mark.parametrize("fork", [False, True])
def test_kills_what_the_tests_catch_and_reports_the_survivor(mutate, project, fork):
    target = mutate.Target("rules.py", ("test_rules.py",), operators=FEW, planted=(
        ("matches * 100 >= 99 * rows", "matches * 100 >= 98 * rows"), ("no such text", "x")))
    runner = mutate.Runner(project, fork=fork)
    try:
        r = mutate.mutate_module("rules", target, project, runner, 30, [], log=lambda s: None)
    finally:
        runner.close()
    survived = [m for m in r["results"] if m["status"] == "survived"]
    assert ("compare", "(matches * 100 > 99 * rows)") in {(m["operator"], m["after"]) for m in survived}
    assert r["mutants"] == 5 and r["killed"] == 2 and r["score"] == pytest.approx(r["killed"] / (r["killed"] + r["survived"]))
    assert 0 < r["score"] < 1
    # the planted bug that weakens the boundary also survives; the one whose text is gone is stale
    planted = [m for m in r["results"] if m["operator"] == "planted"]
    assert [m["status"] for m in planted] == ["survived", "stale"] and r["stale"] == 1
    assert "+    return rows > 0 and matches * 100 >= 98 * rows" in planted[0]["diff"]
    assert (project / "rules.py").read_text() == RULES  # the original is restored
    report = mutate.markdown({"command": "x", "modules": [r]})
    assert "## Survivors in `rules.py`" in report and "(matches * 100 > 99 * rows)" in report


def test_a_reviewed_equivalent_mutant_is_counted_apart(mutate, project):
    target = mutate.Target("rules.py", ("test_rules.py",), operators=FEW)
    equivalent = [{"file": "rules.py", "line": 3, "function": "passes", "operator": "compare",
                   "before": "matches * 100 >= 99 * rows", "after": "(matches * 100 > 99 * rows)",
                   "reason": "for the test's sake"}]
    runner = mutate.Runner(project, fork=False)
    r = mutate.mutate_module("rules", target, project, runner, 30, equivalent, log=lambda s: None)
    assert r["equivalent"] == 1 and r["survived"] == 0 and r["score"] == 1.0
    assert all(m["status"] != "survived" or m["after"] != "(matches * 100 > 99 * rows)" for m in r["results"])


def test_tests_failing_on_the_original_are_an_error_not_a_score(mutate, project):
    (project / "test_rules.py").write_text(TESTS + "\n\ndef test_broken():\n    assert passes(0, 100)\n")
    runner = mutate.Runner(project, fork=False)
    r = mutate.mutate_module("rules", mutate.Target("rules.py", ("test_rules.py",), operators=FEW), project, runner, 30, [],
                             log=lambda s: None)
    assert r["error"].startswith("the tests fail on the unmutated code")


def test_every_target_exists_with_tests_and_the_equivalent_list_matches_a_mutant(mutate):
    for key, t in mutate.TARGETS.items():
        assert t.tests, key
        for test in t.tests:
            assert (REPO / test).is_file(), f"{key}: {test} missing"
    listed = json.loads((REPO / mutate.EQUIVALENT_FILE).read_text())
    assert all(e["reason"].strip() for e in listed)
    for e in listed:  # each reviewed entry still names a mutant the tool makes
        t = next(t for t in mutate.TARGETS.values() if t.path == e["file"])
        keys = {m.key() for m in mutate.mutants_of(REPO / t.path, t.path, t.functions)}
        assert (e["file"], e["function"], e["operator"], e["before"], e["after"]) in keys, e


def test_cli_lists_mutants_and_refuses_an_unknown_module(mutate, capsys):
    assert mutate.main(["--list", "--module", "promotion"]) == 0
    out = capsys.readouterr().out
    assert "evaluator/evidence/disclosure.py" in out and "promotion_reasons" in out
    with pytest.raises(SystemExit) as e:
        mutate.main(["--list", "--module", "no.such.module"])
    assert e.value.code == 2
    assert "error: --module no.such.module: not a target" in capsys.readouterr().err


def test_an_incremental_run_carries_the_killed_and_reruns_the_rest(mutate, project):
    mutants = mutate.mutants_of(project / "rules.py", "rules.py", operators=FEW)
    first = {"run": "earlier", "results": [
        {"file": m.file, "function": m.function, "operator": m.operator, "before": m.before, "after": m.after,
         "status": "survived" if ">" in m.after and ">=" not in m.after else "killed"} for m in mutants]}
    again = mutate.mutants_of(project / "rules.py", "rules.py", operators=FEW)
    assert mutate.carry_killed(again, first) == len(mutants) - 1
    assert [m.after for m in again if m.status == ""] == ["(matches * 100 > 99 * rows)"]
    assert all(m.reason == "carried from the run of earlier" for m in again if m.status == "killed")
