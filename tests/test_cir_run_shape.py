"""The retrieval run stays as thin as the contest run: scripts/run.sh's `_main` reads top to
bottom (parse, check the limits and inputs, open the index, search, write the rows, report)
and hands each step to a helper named for it."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_MAIN_LINES = 60


def _function_lines(path: Path, name: str) -> int:
    """Lines of the module-level function `name` in `path`, decorators left out."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    raise AssertionError(f"{path} defines no function {name}")


def test_the_retrieval_run_main_is_short():
    n = _function_lines(REPO / "evaluator" / "cir" / "run.py", "_main")
    assert n <= MAX_MAIN_LINES, f"evaluator/cir/run.py _main is {n} lines (at most {MAX_MAIN_LINES}): move a step out"


def test_the_measure_counts_a_function_from_def_to_its_last_line(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\n\n\ndef _main():\n    a = 1\n\n    return a\n")
    assert _function_lines(src, "_main") == 4
