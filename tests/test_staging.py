"""The contest ABI's input rules: staged image roots are followed (symlink farms, hard links),
confinement is an opt-in, OUTPUT is never an input or a special file, rows are counted as
Python counts them, and a full disk fails before any image is read."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import shutil
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run_abi, tiny_spec


@pytest.fixture(scope="module")
def null_artifact(tmp_path_factory) -> Path:
    """The `null` backend (class 0 for every image): the whole ABI runs without a model."""
    from engine.tuning import build

    out = tmp_path_factory.mktemp("art_null") / "artifact"
    build(tiny_spec(), None, out, backend="null", device="cpu")
    return out


def _rows(cohort: Path) -> list[str]:
    return (cohort / "manifest.tsv").read_text().splitlines()


def _farm(cohort: Path, base: Path, how: str) -> Path:
    """IMAGE_ROOT staged as a runner would: every image a link into a store outside the root,
    under the manifest's own relative paths."""
    store, root = base / "store", base / f"root-{how}"
    shutil.copytree(cohort / "images", store)
    for line in _rows(cohort):
        rel = line.split("\t", 1)[1]
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        src = store / Path(rel).relative_to("images")
        if how == "hardlink":
            os.link(src, dst)
        else:
            dst.symlink_to(src if how == "symlink" else os.path.relpath(src, dst.parent))
    return root


def _good_rows(cohort: Path) -> list[str]:
    """Manifest rows of the cohort's readable images."""
    broken = {it["path"] for it in json.loads((cohort / "cohort.json").read_text())["items"]
              if it["encoding"].startswith("broken")}
    return [line for line in _rows(cohort) if line.split("\t", 1)[1] not in broken]


def _unreadable(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "unreadable" in line]


def _error_lines(r) -> list[str]:
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return [line for line in r.stderr.splitlines() if line.startswith("run: error:")]


# --- trusted staging ---------------------------------------------------------------------------

@pytest.mark.abi
def test_a_staged_image_root_answers_every_row_as_the_plain_layout(small_cohort, eager_artifact, plain_run,
                                                                  tmp_path):
    r, plain, _ = plain_run                                      # the plain layout: the cohort as it is
    assert r.returncode == 0, r.stderr[-3000:]
    want_lines = len(_unreadable(r.stderr))
    assert want_lines == 3                                      # the cohort's planted broken files
    for how in ("symlink", "relative-symlink", "hardlink"):
        root, out = _farm(small_cohort, tmp_path / how, how), tmp_path / f"{how}.i32"
        r = run_abi(small_cohort / "manifest.tsv", root, out, eager_artifact)
        assert r.returncode == 0, (how, r.stderr[-3000:])
        assert out.read_bytes() == plain.read_bytes(), how
        assert len(_unreadable(r.stderr)) == want_lines, (how, r.stderr[-3000:])


@pytest.mark.abi
def test_a_symlinked_folder_inside_the_root_is_followed(small_cohort, null_artifact, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(small_cohort / "images", store / "images")
    root = tmp_path / "root"
    root.mkdir()
    (root / "images").symlink_to(store / "images")
    report = tmp_path / "timing.json"
    r = run_abi(small_cohort / "manifest.tsv", root, tmp_path / "p.i32", null_artifact, "--report", str(report))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(report.read_text())["failed"] == 3         # only the planted broken files


@pytest.mark.abi
@pytest.mark.parametrize("how", ["flag", "env"])
def test_confinement_is_an_opt_in_that_refuses_the_farm(small_cohort, null_artifact, tmp_path, how):
    root = _farm(small_cohort, tmp_path, "symlink")
    out = tmp_path / "p.i32"
    extra, env = (["--confine"], None) if how == "flag" else ([], {"CONTEST_CONFINE": "1"})
    r = run_abi(small_cohort / "manifest.tsv", root, out, null_artifact, *extra, env=env)
    n = len(_rows(small_cohort))
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.stat().st_size == 4 * n                          # every row still answered
    refused = [line for line in _unreadable(r.stderr) if "escapes IMAGE_ROOT" in line]
    assert len(refused) == n
    # more than half the rows unreadable: one summary line pointing at IMAGE_ROOT
    summary = [line for line in r.stderr.splitlines() if line.startswith("run: warning:")]
    assert len(summary) == 1 and f"{n} of {n} rows" in summary[0] and "IMAGE_ROOT" in summary[0]
    r = run_abi(small_cohort / "manifest.tsv", root, out, null_artifact, "--no-confine", env=env)
    assert r.returncode == 0 and len(_unreadable(r.stderr)) == 3, r.stderr[-3000:]


@pytest.mark.abi
def test_absolute_and_dotdot_paths_stay_refused_per_row(small_cohort, null_artifact, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(small_cohort / "images", root / "images")
    good = _good_rows(small_cohort)[:6]
    inside = root / good[0].split("\t", 1)[1]
    m = tmp_path / "m.tsv"
    m.write_text("\n".join(good + [f"abs\t{inside}", f"up\t../root/{good[0].split(chr(9))[1]}",
                                   "mid\timages/../images/x.JPEG", "empty\t", "\tno-id-but-fine.JPEG"]) + "\n")
    out = tmp_path / "p.i32"
    r = run_abi(m, root, out, null_artifact)
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.stat().st_size == 4 * 11
    lines = _unreadable(r.stderr)
    for rid, why in [("abs", "absolute path refused"), ("up", "'..' component refused"),
                     ("mid", "'..' component refused"), ("empty", "empty path"), ("", "FileNotFoundError")]:
        assert sum(f"({rid}," in line and why in line for line in lines) == 1, (rid, r.stderr)
    assert len(lines) == 5 and not [line for line in r.stderr.splitlines() if "warning" in line]   # 5 of 11


@pytest.mark.abi
def test_a_wrong_image_root_is_loud_but_still_answers(small_cohort, null_artifact, tmp_path):
    out = tmp_path / "p.i32"
    r = run_abi(small_cohort / "manifest.tsv", small_cohort / "images", out, null_artifact)   # one level too deep
    n = len(_rows(small_cohort))
    assert r.returncode == 0 and out.stat().st_size == 4 * n
    summary = [line for line in r.stderr.splitlines() if line.startswith("run: warning:")]
    assert len(summary) == 1 and f"{n} of {n} rows" in summary[0], r.stderr[-2000:]
    assert str(small_cohort / "images") in summary[0]


# --- OUTPUT ------------------------------------------------------------------------------------

def _digest(p: Path) -> tuple:
    st = os.lstat(p)
    data = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
    return st.st_mode, st.st_ino, data


@pytest.mark.abi
@pytest.mark.parametrize("what", ["manifest", "manifest-hardlink", "manifest-symlink", "artifact-manifest",
                                  "artifact-hardlink", "artifact-folder", "image", "image-root-new-file",
                                  "dev-null", "dev-null-symlink", "directory", "fifo", "stdout-link"])
def test_an_output_that_is_an_input_or_a_special_file_is_refused_and_left_intact(small_cohort, null_artifact,
                                                                                 tmp_path, what):
    root = tmp_path / "root"
    shutil.copytree(small_cohort, root)
    art = tmp_path / "artifact"
    shutil.copytree(null_artifact, art)
    manifest = root / "manifest.tsv"
    image = root / _rows(small_cohort)[0].split("\t", 1)[1]
    out = {"manifest": manifest, "manifest-hardlink": tmp_path / "hard.i32", "manifest-symlink": tmp_path / "sym.i32",
           "artifact-manifest": art / "manifest.json", "artifact-hardlink": tmp_path / "art-hard.i32",
           "artifact-folder": art / "predictions.i32", "image": image, "image-root-new-file": root / "p.i32",
           "dev-null": Path("/dev/null"), "dev-null-symlink": tmp_path / "null.i32", "directory": tmp_path / "d.i32",
           "fifo": tmp_path / "fifo.i32", "stdout-link": tmp_path / "stdout.i32"}[what]
    if what == "manifest-hardlink":
        os.link(manifest, out)
    elif what == "manifest-symlink":
        out.symlink_to(manifest)
    elif what == "artifact-hardlink":
        os.link(art / "manifest.json", out)
    elif what == "dev-null-symlink":
        out.symlink_to("/dev/null")
    elif what == "directory":
        out.mkdir()
    elif what == "fifo":
        os.mkfifo(out)
    elif what == "stdout-link":
        out.symlink_to("/proc/self/fd/1")                    # the run's stdout: a pipe here
    protected = [p for p in (out, manifest, image, art / "manifest.json") if os.path.lexists(p)]
    before = {p: _digest(p) for p in protected}
    r = run_abi(manifest, root, out, art, timeout=120)
    errors = _error_lines(r)
    assert r.returncode == 2 and len(errors) == 1 and "OUTPUT" in errors[0], r.stderr[-3000:]
    assert not _unreadable(r.stderr)                          # refused before any image was read
    assert {p: _digest(p) for p in protected} == before
    assert not list(out.parent.glob(f".tmp-{out.name}-*"))
    if what == "image-root-new-file":
        assert not out.exists()


@pytest.mark.abi
def test_a_stale_regular_output_is_replaced_and_a_linked_one_written_through(small_cohort, null_artifact, tmp_path):
    n = len(_rows(small_cohort))
    out = tmp_path / "p.i32"
    out.write_bytes(b"\x07" * 12)
    r = run_abi(small_cohort / "manifest.tsv", small_cohort, out, null_artifact)
    assert r.returncode == 0 and out.read_bytes() == bytes(4 * n)            # null answers class 0
    target, link = tmp_path / "real" / "answers.i32", tmp_path / "link.i32"
    target.parent.mkdir()
    target.write_bytes(b"\x07" * 12)
    link.symlink_to(target)
    r = run_abi(small_cohort / "manifest.tsv", small_cohort, link, null_artifact)
    assert r.returncode == 0, r.stderr[-2000:]
    assert link.is_symlink() and target.read_bytes() == bytes(4 * n)         # as open(OUTPUT, "wb") would


# --- rows as Python counts them ----------------------------------------------------------------

@pytest.mark.abi
def test_cr_only_and_blank_lines_count_rows_as_python_does(small_cohort, eager_artifact, tmp_path):
    rows = _rows(small_cohort)[:12]
    lf = tmp_path / "lf.tsv"
    lf.write_text("\n".join(rows) + "\n")
    base = tmp_path / "lf.i32"
    assert run_abi(lf, small_cohort, base, eager_artifact).returncode == 0
    cr = tmp_path / "cr.tsv"
    cr.write_bytes("\r".join(rows).encode())
    out = tmp_path / "cr.i32"
    r = run_abi(cr, small_cohort, out, eager_artifact)
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.stat().st_size == 48 and out.read_bytes() == base.read_bytes()
    # blank lines in the middle and at the end: skipped, each named, never rows
    blank = tmp_path / "blank.tsv"
    blank.write_bytes(("\n".join(rows[:5] + ["", "   "] + rows[5:]) + "\n\r\n\n").encode())
    report = tmp_path / "timing.json"
    out = tmp_path / "blank.i32"
    r = run_abi(blank, small_cohort, out, eager_artifact, "--report", str(report))
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.read_bytes() == base.read_bytes()
    named = [line for line in r.stderr.splitlines() if "blank line skipped" in line]
    assert [line.split(":")[2] for line in named] == ["6", "7", "15", "16"], r.stderr
    rep = json.loads(report.read_text())
    assert rep["rows"] == 12 and rep["blank_lines_skipped"] == 4
    with open(blank) as f:                                    # the reference's own count agrees
        assert sum(1 for line in f if line.strip()) == 12


# --- a full disk fails before any image is read ------------------------------------------------

def _missing_rows(tmp_path: Path, n: int) -> tuple[Path, Path]:
    """A manifest of `n` rows whose images do not exist: any read would print a line per row."""
    root = tmp_path / "root"
    root.mkdir()
    m = tmp_path / "m.tsv"
    m.write_text("".join(f"r{i}\timages/missing_{i}.JPEG\n" for i in range(n)))
    return m, root


def _assert_failed_before_reading(r, needle: str) -> None:
    errors = _error_lines(r)
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-3000:]
    assert "cannot reserve" in errors[0] and needle in errors[0], errors[0]
    assert not _unreadable(r.stderr)


@pytest.mark.abi
def test_a_file_size_limit_fails_at_the_reservation(null_artifact, tmp_path):
    m, root = _missing_rows(tmp_path, 1000)                  # 4000 bytes to reserve
    out = tmp_path / "o" / "p.i32"
    out.parent.mkdir()
    out.write_bytes(b"stale")

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    r = subprocess.run([str(REPO / "scripts" / "run"), str(m), str(root), str(out)], preexec_fn=limit,
                       env={**os.environ, "ENGINE_ARTIFACT": str(null_artifact)}, capture_output=True, text=True,
                       timeout=120)
    _assert_failed_before_reading(r, os.strerror(errno.EFBIG))
    assert list(out.parent.iterdir()) == []                   # stale OUTPUT removed, temp file too


@pytest.fixture
def tiny_fs(tmp_path):
    """A 64 KiB tmpfs (needs root and a mount namespace that allows it; skipped otherwise)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.abi
def test_a_full_disk_fails_before_any_image_is_read(null_artifact, tmp_path, tiny_fs):
    m, root = _missing_rows(tmp_path, 200)                   # 800 bytes to reserve
    filler = tiny_fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, bytes(4096)):
            pass
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    out = tiny_fs / "p.i32"
    r = run_abi(m, root, out, null_artifact, timeout=120)
    _assert_failed_before_reading(r, os.strerror(errno.ENOSPC))
    assert sorted(p.name for p in tiny_fs.iterdir()) == ["filler"]
    filler.unlink()                                           # with room, the same run succeeds
    r = run_abi(m, root, out, null_artifact, timeout=120)
    assert r.returncode == 0 and out.stat().st_size == 800 and len(_unreadable(r.stderr)) == 200


# --- the output module on its own ----------------------------------------------------------------

def test_the_reservation_writes_zeros_where_fallocate_is_unsupported(tmp_path, monkeypatch):
    from evaluator.contest import output

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(output.os, "posix_fallocate", unsupported)
    out = output.Output(tmp_path / "p.i32")
    out.reserve(4 * 300)
    assert os.fstat(out.fd).st_size == 1200 and out.tmp.read_bytes() == bytes(1200)
    out.commit(np.arange(300, dtype="<i4").tobytes())
    assert (tmp_path / "p.i32").read_bytes() == np.arange(300, dtype="<i4").tobytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.i32"]


def test_a_crash_at_commit_never_leaves_a_complete_looking_output(tmp_path, monkeypatch):
    from evaluator.contest import output

    out = output.Output(tmp_path / "p.i32")
    out.reserve(40)

    def boom(fd):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(output.os, "fsync", boom)
    with pytest.raises(OSError):
        out.commit(np.arange(10, dtype="<i4").tobytes())
    monkeypatch.undo()
    out.discard()
    assert list(tmp_path.iterdir()) == []



def test_in_place_writing_refuses_an_output_with_other_hard_links(tmp_path, monkeypatch):
    """A folder where no temp file can be made: OUTPUT is written in place, unless emptying it
    would empty another name of the same file too."""
    from evaluator.contest import output

    real_open, real_unlink = os.open, os.unlink

    def no_temp_files(path, flags, *mode):
        if Path(path).name.startswith(".tmp-"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *mode)

    def no_unlink(path, *a, **k):                             # a read-only folder: no name can go either
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(output.os, "open", no_temp_files)
    monkeypatch.setattr(output.os, "unlink", no_unlink)
    out, other = tmp_path / "p.i32", tmp_path / "image.JPEG"
    out.write_bytes(b"precious")
    os.link(out, other)
    with pytest.raises(output.OutputError, match="other hard links"):
        output.Output(out)
    assert out.read_bytes() == other.read_bytes() == b"precious"
    monkeypatch.setattr(output.os, "unlink", real_unlink)
    other.unlink()                                            # its only name: written in place
    monkeypatch.setattr(output.os, "unlink", no_unlink)
    o = output.Output(out)
    o.reserve(8)
    o.commit(np.arange(2, dtype="<i4").tobytes())
    assert out.read_bytes() == np.arange(2, dtype="<i4").tobytes()
