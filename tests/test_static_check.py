"""scripts/static_check.py (run by scripts/test.sh) fails on names that do not resolve, also inside
unannotated functions, and on nothing else: mypy is pointed at small files of its own."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import REPO

BROKEN = """\
from engine.decoders import _create, make_decoder
import engine.no_such_module


def uses():
    import engine.core.spec

    return engine.core.spec.NO_SUCH_NAME, make_decoder, undefined_name
"""
# what the check leaves alone: a type error (not a name), and a third-party package's names (Any)
CLEAN = """\
import torch

from engine.decoders import make_decoder


def typed(x: int) -> str:
    return x


def uses():
    return make_decoder, torch.no_such_function
"""


def _check(tmp_path, name: str, source: str) -> subprocess.CompletedProcess:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, str(REPO / "scripts" / "static_check.py"), str(path)],
                          capture_output=True, text=True, timeout=120)


def test_fails_on_each_name_that_does_not_resolve(tmp_path):
    r = _check(tmp_path, "broken.py", BROKEN)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for line, what in ((1, 'Module "engine.decoders" has no attribute "_create"'),
                       (2, 'Cannot find implementation or library stub for module named "engine.no_such_module"'),
                       (8, 'has no attribute "NO_SUCH_NAME"'), (8, 'Name "undefined_name" is not defined')):
        assert any(ln.startswith(f"{tmp_path / 'broken.py'}:{line}: error: ") and what in ln for ln in lines), \
            (line, what, lines)
    assert len(lines) == 4, lines


def test_passes_a_file_whose_names_resolve(tmp_path):
    r = _check(tmp_path, "clean.py", CLEAN)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout == "", r.stdout
