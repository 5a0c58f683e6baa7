"""The output reservation's rules, unit by unit (no model, no run): what OUTPUT may not be,
which stale files go, the reservation's size, the atomic commit and the discard."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from evaluator.contest import output
from evaluator.contest.output import Output, OutputError, refusal, stale


@pytest.fixture
def inputs(tmp_path):
    manifest = tmp_path / "manifest.tsv"
    manifest.write_text("r1\ta.JPEG\n")
    images = tmp_path / "images"
    images.mkdir()
    (images / "a.JPEG").write_bytes(b"jpeg")
    art = tmp_path / "art"
    art.mkdir()
    (art / "manifest.json").write_text("{}")
    (art / "weights.safetensors").write_bytes(b"w")
    return manifest, images, art


def test_a_plain_new_output_is_allowed(inputs, tmp_path):
    assert refusal(tmp_path / "p.i32", *inputs) is None
    assert refusal(tmp_path / "p.i32") is None  # nothing to compare with
    existing = tmp_path / "old.i32"
    existing.write_bytes(b"old")
    assert refusal(existing, tmp_path / "absent.tsv", *inputs[1:]) is None  # a manifest that cannot be stat'ed
    assert refusal(tmp_path / "images_p.i32", *inputs) is None  # a sibling sharing a prefix is outside


def test_output_that_is_the_manifest_by_name_link_or_hard_link(inputs, tmp_path):
    manifest = inputs[0]
    assert refusal(manifest, *inputs) == f"OUTPUT is the manifest: {manifest}"
    link = tmp_path / "link.i32"
    link.symlink_to(manifest)
    assert refusal(link, *inputs) == f"OUTPUT is the manifest: {link}"
    hard = tmp_path / "hard.i32"
    os.link(manifest, hard)
    assert refusal(hard, *inputs) == f"OUTPUT is the manifest: {hard}"
    assert refusal(manifest, None, *inputs[1:]) is None  # without a manifest nothing is compared


def test_output_inside_the_image_root_or_the_artifact(inputs, tmp_path):
    manifest, images, art = inputs
    new = images / "sub" / "p.i32"
    assert refusal(new, *inputs) == f"OUTPUT is inside IMAGE_ROOT ({images}): {new}"
    assert refusal(images / "a.JPEG", *inputs).startswith("OUTPUT is inside IMAGE_ROOT")
    assert refusal(art / "new.i32", *inputs) == f"OUTPUT is a file of the artifact {art}: {art / 'new.i32'}"
    hard = tmp_path / "weights_link"
    os.link(art / "manifest.json", hard)  # a hard link to an artifact file, outside the folder
    assert refusal(hard, *inputs) == f"OUTPUT is a file of the artifact {art}: {hard}"
    assert refusal(hard, manifest, images, tmp_path / "no_such_artifact") is None


@pytest.mark.parametrize("kind", ["dir", "fifo", "chr"])
def test_output_that_is_not_a_regular_file(inputs, tmp_path, kind):
    if kind == "dir":
        path, what = tmp_path / "d", "a directory"
        path.mkdir()
    elif kind == "fifo":
        path, what = tmp_path / "f", "a FIFO (or pipe)"
        os.mkfifo(path)
    else:
        path, what = Path("/dev/null"), "a character device"
    assert refusal(path, *inputs) == f"OUTPUT is {what}, not a regular file: {path}"
    with pytest.raises(OutputError, match="not a regular file"):
        Output(path, *inputs)


@pytest.fixture
def live():
    """A process of this test's own that stays alive while the test runs."""
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def test_stale_names_only_dead_processes_with_the_prefix(live):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert stale(f".tmp-p.i32-{dead}", ".tmp-p.i32-")
    assert not stale(f".tmp-p.i32-{os.getpid()}", ".tmp-p.i32-")  # this process
    assert not stale(f".tmp-q.i32-{dead}", ".tmp-p.i32-")
    assert not stale(".tmp-p.i32-abc", ".tmp-p.i32-")
    assert not stale(f".tmp-p.i32-{live.pid}", ".tmp-p.i32-")  # alive
    with pytest.raises(subprocess.TimeoutExpired):  # asking whether it runs sends it no signal
        live.wait(timeout=0.3)


def test_a_stale_output_and_unheld_temp_files_go_a_held_one_stops_the_run(inputs, tmp_path, live):
    """A temp file's name proves nothing (PIDs repeat across containers); its lock does."""
    from engine.io import create_locked_temp

    out = tmp_path / "p.i32"
    out.write_bytes(b"old answers")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / f".tmp-p.i32-{dead}").write_bytes(b"x")
    unheld = tmp_path / f".tmp-p.i32-{live.pid}"       # named after a live process, but not held
    unheld.write_bytes(b"x")
    o = Output(out, *inputs)
    try:
        assert not out.exists()  # an earlier run's file never passes for this one's
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")) == [o.tmp.name]
        assert o.tmp.name.startswith(".tmp-p.i32-") and o.tmp.exists()
    finally:
        o.discard()
    out.write_bytes(b"old answers")
    fd, held = create_locked_temp(out)                  # another run, alive, reserving this OUTPUT
    try:
        with pytest.raises(OutputError, match="another run is writing OUTPUT now"):
            Output(out, *inputs)
        assert held.exists() and out.read_bytes() == b"old answers"
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")) == [held.name]
    finally:
        os.close(fd)


def test_reserve_commit_and_discard(inputs, tmp_path):
    out = tmp_path / "p.i32"
    o = Output(out, *inputs)
    o.reserve(4 * 5)
    assert o.tmp.stat().st_size == 20 and not out.exists()
    o.commit(b"\x01\x00\x00\x00" * 3)  # fewer bytes than reserved: no tail is left
    assert out.read_bytes() == b"\x01\x00\x00\x00" * 3 and not o.tmp.exists() and o.done and o.fd is None
    o.discard()  # after a commit: the output stays
    assert out.exists()
    o2 = Output(tmp_path / "q.i32", *inputs)
    o2.reserve(0)
    assert o2.tmp.stat().st_size == 0
    o2.discard()
    assert not o2.tmp.exists() and not (tmp_path / "q.i32").exists() and o2.fd is None


def test_reserve_writes_zeros_where_fallocate_cannot(inputs, tmp_path, monkeypatch):
    import errno

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(output.os, "posix_fallocate", unsupported)
    o = Output(tmp_path / "p.i32", *inputs)
    try:
        o.reserve((1 << 20) + 12)  # more than one block of zeros
        assert o.tmp.read_bytes() == bytes((1 << 20) + 12)
        assert os.lseek(o.fd, 0, os.SEEK_CUR) == 0  # the answers are written from the start
    finally:
        o.discard()


def test_reserve_failure_is_one_output_error(inputs, tmp_path, monkeypatch):
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output.os, "posix_fallocate", full)
    o = Output(tmp_path / "p.i32", *inputs)
    try:
        with pytest.raises(OutputError) as e:
            o.reserve(8)
        assert str(e.value) == f"cannot reserve 8 bytes for OUTPUT at {o.tmp}: No space left on device"
    finally:
        o.discard()


def test_a_missing_folder_is_refused(inputs, tmp_path):
    with pytest.raises(OutputError, match="OUTPUT folder does not exist"):
        Output(tmp_path / "no" / "p.i32", *inputs)


def test_a_link_output_is_written_through(inputs, tmp_path):
    target = tmp_path / "real.i32"
    link = tmp_path / "link.i32"
    link.symlink_to(target)
    o = Output(link, *inputs)
    o.commit(b"\x02\x00\x00\x00")
    assert link.is_symlink() and target.read_bytes() == b"\x02\x00\x00\x00"


def test_a_temp_file_of_another_users_process_is_left_alone(monkeypatch):
    """kill(pid, 0) answering EPERM means the process runs under another user: not stale."""
    def not_permitted(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(output.os, "kill", not_permitted)
    assert not stale(".tmp-p.i32-12345", ".tmp-p.i32-")


def test_a_leftover_temp_file_of_this_process_is_replaced(inputs, tmp_path):
    mine = tmp_path / f".tmp-p.i32-{os.getpid()}"
    mine.write_bytes(b"left by an earlier Output of this process")
    old = os.umask(0o022)
    try:
        o = Output(tmp_path / "p.i32", *inputs)
    finally:
        os.umask(old)
    o.reserve(4)
    o.commit(b"\x03\x00\x00\x00")
    assert (tmp_path / "p.i32").read_bytes() == b"\x03\x00\x00\x00" and not mine.exists()
    assert (tmp_path / "p.i32").stat().st_mode & 0o777 == 0o644


def test_the_output_file_mode_is_0644_under_umask_022(inputs, tmp_path):
    old = os.umask(0o022)
    try:
        o = Output(tmp_path / "p.i32", *inputs)
        o.commit(b"")
    finally:
        os.umask(old)
    assert (tmp_path / "p.i32").stat().st_mode & 0o777 == 0o644


def test_reserve_allocates_even_one_byte(inputs, tmp_path):
    o = Output(tmp_path / "p.i32", *inputs)
    try:
        o.reserve(1)
        assert o.tmp.stat().st_size == 1
    finally:
        o.discard()


def test_an_unwritable_folder_is_one_output_error():
    """/proc takes no new file (even for root): the temp file cannot be made and OUTPUT is no file."""
    with pytest.raises(OutputError, match="cannot write OUTPUT in /proc"):
        Output(Path("/proc/p.i32"))


def _folder_refuses_changes(monkeypatch, path: Path, open_fails: bool = False):
    """As root every folder is writable: refuse unlinking OUTPUT and creating the temp file (and,
    with open_fails, opening OUTPUT itself) as a read-only folder would."""
    real_open, real_unlink = os.open, os.unlink

    def unlink(p, *a, **k):
        if Path(p) == path:
            raise PermissionError(13, "Permission denied")
        return real_unlink(p, *a, **k)

    def open_(p, flags, *a, **k):
        if Path(p).name.startswith(".tmp-") or (open_fails and Path(p) == path):
            raise PermissionError(13, "Permission denied")
        return real_open(p, flags, *a, **k)

    monkeypatch.setattr(output.os, "unlink", unlink)
    monkeypatch.setattr(output.os, "open", open_)


def test_a_writable_output_in_an_unwritable_folder_is_written_in_place(inputs, tmp_path, monkeypatch):
    out = tmp_path / "p.i32"
    out.write_bytes(b"old answers, longer than the new")
    _folder_refuses_changes(monkeypatch, out)
    o = Output(out, *inputs)
    assert o.tmp is None and out.stat().st_size == 0  # emptied now: stale answers never pass
    o.commit(b"\x04\x00\x00\x00")
    assert out.read_bytes() == b"\x04\x00\x00\x00"
    again = Output(out, *inputs)
    again.discard()                                   # in place, nothing committed: no temp file to remove
    assert out.exists() and out.stat().st_size == 0 and again.fd is None


def test_a_second_run_in_place_stops_and_leaves_the_first_ones_output(inputs, tmp_path, monkeypatch):
    out = tmp_path / "p.i32"
    out.write_bytes(b"old")
    _folder_refuses_changes(monkeypatch, out)
    first = Output(out, *inputs)
    out_fd = os.open(out, os.O_WRONLY)
    os.write(out_fd, b"\x05\x00\x00\x00")             # the first run's answers, on their way
    os.close(out_fd)
    with pytest.raises(OutputError, match="another run is writing OUTPUT in place now"):
        Output(out, *inputs)
    assert out.read_bytes() == b"\x05\x00\x00\x00"      # not emptied by the second run
    first.commit(b"\x06\x00\x00\x00")
    assert out.read_bytes() == b"\x06\x00\x00\x00"


def test_an_in_place_output_on_a_filesystem_without_flock_is_written_not_refused(inputs, tmp_path, monkeypatch):
    """No flock there proves no other writer: OUTPUT is written in place unguarded (as a temp file
    there is), not refused as if another run held it."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    out = tmp_path / "p.i32"
    out.write_bytes(b"old")
    _folder_refuses_changes(monkeypatch, out)
    monkeypatch.setattr(fcntl, "flock", no_locks)
    o = Output(out, *inputs)
    assert o.tmp is None and out.stat().st_size == 0
    o.commit(b"\x09\x00\x00\x00")
    assert out.read_bytes() == b"\x09\x00\x00\x00"


def test_an_in_place_output_with_other_hard_links_is_refused(inputs, tmp_path, monkeypatch):
    out = tmp_path / "p.i32"
    out.write_bytes(b"old")
    os.link(out, tmp_path / "other_name")
    _folder_refuses_changes(monkeypatch, out)
    with pytest.raises(OutputError, match="OUTPUT has other hard links"):
        Output(out, *inputs)
    assert (tmp_path / "other_name").read_bytes() == b"old"


def test_in_place_output_that_cannot_be_opened_is_one_error(inputs, tmp_path, monkeypatch):
    out = tmp_path / "p.i32"
    out.write_bytes(b"old")
    _folder_refuses_changes(monkeypatch, out, open_fails=True)
    with pytest.raises(OutputError, match=f"cannot write OUTPUT {out}: Permission denied"):
        Output(out, *inputs)


def test_an_existing_output_it_may_not_write_is_not_written_in_place(inputs, tmp_path, monkeypatch):
    out = tmp_path / "p.i32"
    out.write_bytes(b"old")
    _folder_refuses_changes(monkeypatch, out)
    real_access = os.access
    monkeypatch.setattr(output.os, "access", lambda p, mode: False if Path(p) == out else real_access(p, mode))
    with pytest.raises(OutputError, match=f"cannot write OUTPUT in {tmp_path}: Permission denied"):
        Output(out, *inputs)
    assert out.read_bytes() == b"old"


def test_commit_writes_everything_through_short_writes(inputs, tmp_path, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(output.os, "write", lambda fd, data: real_write(fd, bytes(data[:3])))  # at most 3 bytes
    o = Output(tmp_path / "p.i32", *inputs)
    o.reserve(16)
    data = bytes(range(1, 17))
    o.commit(data)
    assert (tmp_path / "p.i32").read_bytes() == data


def test_commit_and_discard_close_their_file(inputs, tmp_path):
    before = set(os.listdir("/proc/self/fd"))
    o = Output(tmp_path / "p.i32", *inputs)
    o.commit(b"\x05\x00\x00\x00")
    o2 = Output(tmp_path / "q.i32", *inputs)
    o2.discard()
    assert set(os.listdir("/proc/self/fd")) == before


def _output_may_not_be_removed(monkeypatch, path: Path):
    """A sticky folder (/tmp) holding another user's OUTPUT: the temp file can be made, OUTPUT not unlinked."""
    real_unlink = os.unlink

    def unlink(p, *a, **k):
        if Path(p) == path:
            raise PermissionError(1, "Operation not permitted")
        return real_unlink(p, *a, **k)

    monkeypatch.setattr(output.os, "unlink", unlink)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_stale_output_it_may_not_remove_is_written_in_place_leaving_no_temp_file(inputs, tmp_path, monkeypatch):
    out = tmp_path / "p.i32"
    out.write_bytes(b"old answers, longer than the new")
    _output_may_not_be_removed(monkeypatch, out)
    before = _fds()
    o = Output(out, *inputs)
    assert o.tmp is None and out.stat().st_size == 0          # written in place, emptied now
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]   # its temp file is gone
    o.commit(b"\x07\x00\x00\x00")
    assert out.read_bytes() == b"\x07\x00\x00\x00" and _fds() == before      # and closed


def test_a_stale_output_it_may_neither_remove_nor_write_is_one_error_naming_the_cause(inputs, tmp_path,
                                                                                     monkeypatch):
    out = tmp_path / "p.i32"
    out.write_bytes(b"old")
    _output_may_not_be_removed(monkeypatch, out)
    real_access = os.access
    monkeypatch.setattr(output.os, "access", lambda p, mode: False if Path(p) == out else real_access(p, mode))
    before = _fds()
    with pytest.raises(OutputError, match=f"cannot write OUTPUT in {tmp_path}: Operation not permitted"):
        Output(out, *inputs)
    assert out.read_bytes() == b"old" and _fds() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_a_second_run_in_place_closes_what_it_opened(inputs, tmp_path, monkeypatch):
    out = tmp_path / "p.i32"
    out.write_bytes(b"old")
    _folder_refuses_changes(monkeypatch, out)
    first = Output(out, *inputs)
    before = _fds()
    with pytest.raises(OutputError, match="another run is writing OUTPUT in place now"):
        Output(out, *inputs)
    assert _fds() == before
    first.discard()


@pytest.mark.parametrize("how", ["replaced", "removed"])
def test_a_temp_file_taken_away_before_the_commit_is_one_error_and_no_output(inputs, tmp_path, how):
    out = tmp_path / "p.i32"
    o = Output(out, *inputs)
    os.unlink(o.tmp)
    if how == "replaced":
        o.tmp.write_bytes(b"another process's bytes")
    with pytest.raises(OutputError, match="is no longer this run's .* OUTPUT not written"):
        o.commit(b"\x08\x00\x00\x00")
    assert not out.exists()
    o.discard()                                          # another's file at that name is not removed
    assert o.tmp.exists() == (how == "replaced") and o.fd is None
