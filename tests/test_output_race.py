"""Two runs on one OUTPUT: temp files are never shared, a live run's temp file is never taken for
an abandoned one, and OUTPUT is absent or one whole run's answer.

The runs are the Output writer of evaluator.contest.output driven from threads (flock locks of
two open files conflict within one process as between two), one frozen between its reservation
and its commit by an Event, and a child process that holds a reservation while it lives."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.io import create_locked_temp, remove_abandoned, temp_prefix, write_atomic
from evaluator.contest.output import Output, OutputError

REPO = Path(__file__).resolve().parents[1]
ROWS = 57                                   # 228 bytes of answers


def _answers(value: int) -> bytes:
    return value.to_bytes(4, "little") * ROWS


def _frozen_run(out: Path, value: int, reserved: threading.Event, release: threading.Event, errors: list):
    """A run that reserves OUTPUT, then waits for `release` before it commits its answers."""
    try:
        o = Output(out)
        o.reserve(4 * ROWS)
        reserved.set()
        release.wait(30)
        o.commit(_answers(value))
    except BaseException as e:   # noqa: BLE001 - reported to the test thread
        errors.append(e)
        reserved.set()


def test_a_second_run_while_the_first_is_frozen_stops_and_the_first_one_wins(tmp_path):
    out = tmp_path / "p.i32"
    reserved, release, errors = threading.Event(), threading.Event(), []
    first = threading.Thread(target=_frozen_run, args=(out, 7, reserved, release, errors))
    first.start()
    try:
        assert reserved.wait(30) and not errors, errors
        held = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-p.i32-")]
        assert len(held) == 1 and held[0].stat().st_size == 4 * ROWS
        with pytest.raises(OutputError) as e:
            Output(out)                                              # the second run, same PID
        assert str(e.value).startswith("another run is writing OUTPUT now") and "\n" not in str(e.value)
        assert [p for p in tmp_path.iterdir()] == held               # nothing of the first run removed
    finally:
        release.set()
        first.join(30)
    assert not errors, errors
    assert out.read_bytes() == _answers(7)                           # whole, not the second run's zeros
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.i32"]


def test_temp_names_sort_by_creation_and_an_existing_name_is_never_reused(tmp_path, monkeypatch):
    import secrets
    import time

    out = tmp_path / "p.i32"
    taken = tmp_path / f"{temp_prefix(out)}{1:016x}aaaaaaaa"
    taken.write_bytes(b"someone's")
    draws = iter(["aaaaaaaa", "bbbbbbbb"])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(draws))
    monkeypatch.setattr(time, "time_ns", lambda: 1)
    fd, tmp = create_locked_temp(out)
    try:
        assert tmp.name == f"{temp_prefix(out)}{1:016x}bbbbbbbb"     # O_EXCL: the taken name drawn again
        assert taken.read_bytes() == b"someone's"
    finally:
        os.close(fd)
    monkeypatch.undo()
    names = []
    for _ in range(2):
        fd, tmp = create_locked_temp(out)
        names.append(tmp.name)
        os.close(fd)
    assert names[0] < names[1] and not any(n.endswith(f"-{os.getpid()}") for n in names)


def test_both_runs_finishing_leave_the_last_whole_answer(tmp_path):
    """Should two runs both get past their start (a tie in the order of their temp files), each
    commit renames a whole file: the last one is OUTPUT, never a torn or zeroed one."""
    out = tmp_path / "p.i32"
    a = Output(out)
    fd, tmp = create_locked_temp(out)             # a second run's reservation made meanwhile
    b = Output.__new__(Output)
    b.path, b.fd, b.tmp, b.done = Path(os.path.realpath(out)), fd, tmp, False
    a.reserve(4 * ROWS)
    b.reserve(4 * ROWS)
    a.commit(_answers(1))
    assert out.read_bytes() == _answers(1)
    b.commit(_answers(2))
    assert out.read_bytes() == _answers(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.i32"]


def test_a_commit_whose_temp_file_was_replaced_writes_nothing(tmp_path):
    out = tmp_path / "p.i32"
    o = Output(out)
    o.reserve(4)
    o.tmp.unlink()
    o.tmp.write_bytes(bytes(4))                   # someone else's file under this run's temp name
    with pytest.raises(OutputError, match="no longer this run's"):
        o.commit(_answers(3))
    o.discard()
    assert not out.exists()


_HOLDER = """
import sys
from evaluator.contest.output import Output
o = Output(sys.argv[1])
o.reserve(16)
print(o.tmp.name, flush=True)
sys.stdin.read()          # frozen until the test closes stdin (or kills it)
o.commit(bytes([9]) * 16)
"""


def _holder(out: Path) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], cwd=REPO, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return p, p.stdout.readline().strip()


def test_a_live_run_in_another_process_is_left_alone_and_wins(tmp_path):
    out = tmp_path / "p.i32"
    p, name = _holder(out)
    try:
        assert name and (tmp_path / name).exists(), p.stderr
        with pytest.raises(OutputError, match="another run is writing OUTPUT now"):
            Output(out)
        assert (tmp_path / name).exists()
    finally:
        p.stdin.close()
        assert p.wait(30) == 0
    assert out.read_bytes() == bytes([9]) * 16


def test_a_killed_runs_temp_file_is_removed_by_the_next_run(tmp_path):
    out = tmp_path / "p.i32"
    out.write_bytes(b"an earlier run's answers")
    p, name = _holder(out)
    p.kill()
    p.wait(30)
    assert (tmp_path / name).exists()             # the killed run left it
    o = Output(out)                                # its lock died with it: abandoned, removed
    try:
        assert not (tmp_path / name).exists() and not out.exists()
        assert sorted(q.name for q in tmp_path.iterdir()) == [o.tmp.name]
    finally:
        o.discard()


def test_a_cleaner_removes_only_temp_files_whose_lock_it_can_take(tmp_path):
    out = tmp_path / "x.json"
    fd, held = create_locked_temp(out)
    left = tmp_path / f"{temp_prefix(out)}12345"   # an older run's name, its owner gone
    left.write_bytes(b"x")
    other = tmp_path / ".tmp-y.json-1"
    other.write_bytes(b"y")
    try:
        assert remove_abandoned(tmp_path, temp_prefix(out)) == [held]
        assert held.exists() and not left.exists() and other.exists()
    finally:
        os.close(fd)
    assert remove_abandoned(tmp_path, temp_prefix(out)) == [] and not held.exists()


def test_two_atomic_writers_of_one_path_never_share_a_temp_file(tmp_path):
    path = tmp_path / "meta.json"
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def writer(i: int):
        try:
            start.wait(10)
            for _ in range(25):
                write_atomic(path, bytes([i]) * 4096)
        except BaseException as e:   # noqa: BLE001 - reported to the test thread
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    data = path.read_bytes()
    assert not errors and len(data) == 4096 and len(set(data)) == 1 and data[0] in (1, 2, 3, 4)
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]


@pytest.mark.abi
def test_the_abi_refuses_a_second_run_on_one_output_in_one_line(tmp_path):
    """scripts/run while another run holds OUTPUT: one error line, exit 2, the other run's files kept."""
    out = tmp_path / "p.i32"
    m = tmp_path / "m.tsv"
    m.write_text("r1\ta.JPEG\n")
    (tmp_path / "images").mkdir()
    p, name = _holder(out)
    try:
        r = subprocess.run([str(REPO / "scripts" / "run"), str(m), str(tmp_path / "images"), str(out)],
                           capture_output=True,
                           text=True, timeout=120, env={**os.environ, "ENGINE_ARTIFACT": str(tmp_path / "none")})
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("run: error:")]
        assert r.returncode == 2 and len(lines) == 1 and "another run is writing OUTPUT now" in lines[0], r.stderr
        assert "Traceback" not in r.stderr and (tmp_path / name).exists() and not out.exists()
    finally:
        p.stdin.close()
        assert p.wait(30) == 0
    assert out.read_bytes() == bytes([9]) * 16


def test_where_flock_is_unsupported_temp_files_are_made_and_never_taken_for_live_or_abandoned(tmp_path,
                                                                                             monkeypatch):
    import errno
    import fcntl

    def unsupported(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", unsupported)
    out = tmp_path / "p.i32"
    left = tmp_path / f"{temp_prefix(out)}0"       # a killed run's: nothing proves it abandoned
    left.write_bytes(b"x")
    o = Output(out)                                # not refused: nothing proves it alive either
    o.reserve(4)
    o.commit(_answers(4)[:4])
    assert out.read_bytes() == _answers(4)[:4] and left.exists()
