"""A full disk is one line that names where: the file being written, or TMPDIR for a load."""
from __future__ import annotations

import errno
import os

import pytest
from cir_helpers import corpus, run_args


def _full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_contest_load_that_fills_tmpdir_names_it(tmp_path, monkeypatch, capsys):
    import engine
    from evaluator.contest import run as run_mod

    def load(*a, **k):
        try:
            _full()
        except OSError as e:   # as engine.load turns it into a LoadError
            raise engine.LoadError(f"cannot load artifact x: {e}", "runtime") from None

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):   # main sets them
        monkeypatch.setenv(var, os.environ.get(var, "1"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(engine, "load", load)
    (tmp_path / "images").mkdir()
    (tmp_path / "m.tsv").write_text("r1\ta.JPEG\n")
    rc = run_mod.main([str(tmp_path / "m.tsv"), str(tmp_path / "images"), str(tmp_path / "p.i32")])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "No space left on device" in err[0] and f"while writing under TMPDIR {tmp_path}" in err[0]
    assert not (tmp_path / "p.i32").exists()


def test_a_query_output_on_a_full_disk_names_the_output(tmp_path, monkeypatch, capsys):
    from evaluator.cir import run as cir_run

    monkeypatch.setattr(cir_run, "answer", _full)
    out = tmp_path / "o.jsonl"
    assert cir_run.main(run_args(corpus() / "requests.jsonl", out)) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith(f"{cir_run.PROG}: error:")]
    assert errors == [f"{cir_run.PROG}: error: No space left on device: {out}"]


def test_an_index_file_on_a_full_disk_names_the_file(tmp_path, monkeypatch):
    from engine import io
    from engine.cli import one_line

    monkeypatch.setattr(io.os, "fsync", _full)
    with pytest.raises(OSError) as e:
        io.write_atomic(tmp_path / "meta.json", b"{}")
    assert one_line(e.value) == f"No space left on device: {tmp_path / 'meta.json'}"
    assert list(tmp_path.iterdir()) == []        # the temp file went too
