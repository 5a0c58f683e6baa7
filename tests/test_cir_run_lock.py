"""scripts/run.sh holds its OUTPUT for its whole life: a second run on the same output, whatever
its flags (resume, --fresh, another --method, a symlink to it), stops in one line and leaves the
output and its record byte for byte as they were; the first run completes a valid output; a
killed run's lock dies with it; a filesystem without flock runs unguarded, said."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys

import pytest
from cir_helpers import REPO, built_index, check_abi, corpus, read_rows, requests_of, run_args, script

from engine.retrieval.index import load_index
from evaluator.cir import run as cir_run

BUSY = "scripts/run.sh: error: another run is writing OUTPUT now"


class PausedRun:
    """The query ABI as a whole process that stops after writing and flushing `after` rows, until
    `resume()` (or a kill): a first run caught in the middle of its output, deterministically."""

    def __init__(self, tmp_path, output, after: int):
        self.go = tmp_path / f"go-{output.name}"
        code = ("import os, sys, time\nfrom evaluator.cir import run\n"
                "def on_row(n):\n"
                f"    if n == {after}:\n"
                "        print('paused', flush=True)\n"
                "        while not os.path.exists(sys.argv[1]):\n"
                "            time.sleep(0.02)\n"
                "sys.exit(run.main(sys.argv[2:], on_row=on_row))")
        env = {**os.environ, "PYTHONPATH": str(REPO), "CLIP_DEVICE": "cpu"}
        self.stderr = open(tmp_path / f"first-{output.name}.stderr", "w+")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(self.go),
                                      *run_args(corpus() / "requests.jsonl", output, "--batch-size", "4")],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        line = self.proc.stdout.readline()           # blocks until the row is on disk (or the run died)
        assert line.strip() == "paused", self.err()

    def err(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-3000:]

    def resume(self) -> int:
        self.go.touch()
        return self.proc.wait(timeout=300)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(timeout=60) == -signal.SIGKILL


def _second(output, *flags: str):
    return script("run.sh", "--index-dir", str(built_index()), "--queries", str(corpus() / "requests.jsonl"),
                  "--output", str(output), *flags, timeout=120)


def _refused_in_one_line(r) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(BUSY), r.stderr[-3000:]


def _snapshot(*paths) -> list[tuple[bytes, int]]:
    return [(p.read_bytes(), p.stat().st_mtime_ns) for p in paths]


def _rows_by_query(path) -> dict[str, dict]:
    return {str(r["query_id"]): r for r in read_rows(path)}


@pytest.mark.abi
def test_a_second_run_on_an_output_being_written_is_refused_whatever_its_flags(tmp_path):
    out = tmp_path / "o.jsonl"
    record = tmp_path / "o.jsonl.run.json"
    link = tmp_path / "link.jsonl"
    link.symlink_to(out)
    first = PausedRun(tmp_path, out, after=20)
    try:
        before = _snapshot(out, record)
        assert len(read_rows(out)) == 20
        for target, flags in [(out, ()), (out, ("--fresh",)), (out, ("--method", "sum")),
                              (link, ("--no-resume", "--method", "sum"))]:
            r = _second(target, *flags)
            _refused_in_one_line(r)
            assert _snapshot(out, record) == before, (target, flags)       # OUTPUT and record untouched
            assert not (tmp_path / "link.jsonl.run.json").exists()
        assert first.resume() == 0, first.err()
    finally:
        if first.proc.poll() is None:
            first.kill()
    rows = read_rows(out)                                                   # the first run's output: whole
    check_abi(rows, requests_of(corpus() / "requests.jsonl"), load_index(built_index()).ids)
    assert [r["query_id"] for r in rows] == [r["query_id"] for r in requests_of(corpus() / "requests.jsonl")]


@pytest.mark.abi
def test_a_killed_run_does_not_block_the_next(tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    first = PausedRun(tmp_path, out, after=8)
    try:
        _refused_in_one_line(_second(out))                                 # held while it lives...
    finally:
        first.kill()                                                        # ...and free once it is gone
    assert len(read_rows(out)) == 8
    assert cir_run.main(run_args(corpus() / "requests.jsonl", out, "--batch-size", "4")) == 0
    assert "8 rows kept" in capsys.readouterr().err
    check_abi(read_rows(out), requests_of(corpus() / "requests.jsonl"), load_index(built_index()).ids)


def test_an_output_held_by_another_open_file_is_refused_before_any_work(tmp_path, capsys):
    """The lock is the one engine.io.open_locked takes (the contest's in-place OUTPUT too): held by
    any other open file of OUTPUT, a run stops before reading the index, and creates nothing."""
    from engine.io import open_locked

    out = tmp_path / "o.jsonl"
    out.write_bytes(b'{"query_id": "partial')                           # someone's row, on its way
    fd, locked = open_locked(out, os.O_RDWR)
    try:
        assert locked
        args = run_args(corpus() / "requests.jsonl", out, "--fresh")
        args[args.index("--index-dir") + 1] = str(tmp_path / "no-index")  # never opened: the lock comes first
        capsys.readouterr()                                                # (the shared fixtures' progress)
        assert cir_run.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(BUSY) and str(out) in err[0], err
        assert out.read_bytes() == b'{"query_id": "partial' and sorted(os.listdir(tmp_path)) == ["o.jsonl"]
    finally:
        os.close(fd)
    assert cir_run.main(args) == 2                                         # released: now the index is missing
    assert "meta.json is missing" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["o.jsonl"]
    args[args.index("--output") + 1] = str(tmp_path / "new.jsonl")
    assert cir_run.main(args) == 2                                         # created to be held, never written:
    assert sorted(os.listdir(tmp_path)) == ["o.jsonl"]                     # removed again


def test_a_filesystem_without_flock_runs_unguarded_and_says_so(tmp_path, monkeypatch, capsys):
    import fcntl

    real_flock = fcntl.flock

    def no_flock(fd, op):
        if os.path.realpath(f"/proc/self/fd/{fd}") == str(tmp_path / "o.jsonl"):
            raise OSError(errno.ENOLCK, "No locks available")
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", no_flock)
    out = tmp_path / "o.jsonl"
    assert cir_run.main(run_args(corpus() / "requests.jsonl", out)) == 0
    err = capsys.readouterr().err
    assert "has no file locks (flock)" in err and "not refused" in err, err[-3000:]
    check_abi(read_rows(out), requests_of(corpus() / "requests.jsonl"), load_index(built_index()).ids)

