"""The input readers' limits at their boundaries (the manifest's size cap, path resolution):
cases the mutation run found no test for."""
from __future__ import annotations

import pytest

from evaluator.contest.manifest import ManifestError, read_manifest


def test_a_manifest_over_the_size_limit_is_refused_before_a_byte_is_read(tmp_path):
    """A sparse file one byte over 1 GiB: refused on its size alone, the limit named."""
    path = tmp_path / "huge.tsv"
    with open(path, "wb") as f:
        f.truncate((1 << 30) + 1)
    with pytest.raises(ManifestError) as e:
        read_manifest(path)
    assert f"has {(1 << 30) + 1} bytes, above the limit of {1 << 30} (the manifest limit)" in str(e.value)


def _short_reads(monkeypatch, most: int, then_empty: bool = False):
    """os.read as a slow or shrinking file would answer: at most `most` bytes a call
    (with then_empty, nothing after the first call)."""
    import os

    from engine import io as engine_io

    real_read, calls = os.read, []

    def read(fd, n):
        calls.append(n)
        if then_empty and len(calls) > 1:
            return b""
        return real_read(fd, min(n, most))

    monkeypatch.setattr(engine_io.os, "read", read)
    return calls


def test_read_regular_reads_the_rest_after_a_short_read(tmp_path, monkeypatch):
    from engine.io import read_regular

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(10)))
    calls = _short_reads(monkeypatch, 3)
    assert read_regular(path, 100) == bytes(range(10)) and len(calls) == 4


def test_read_regular_stops_when_the_file_ends_early(tmp_path, monkeypatch):
    from engine.io import read_regular

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(10)))
    _short_reads(monkeypatch, 3, then_empty=True)
    assert read_regular(path, 100) == bytes(range(3))  # what there was; never a loop


def test_read_regular_closes_its_file_on_every_path(tmp_path):
    import os

    from engine.io import read_regular

    good = tmp_path / "f.bin"
    good.write_bytes(b"abc")
    before = set(os.listdir("/proc/self/fd"))
    assert read_regular(good, 100) == b"abc"
    for bad in (tmp_path, good):                                  # a directory; a file over the limit
        with pytest.raises(ValueError):
            read_regular(bad, 2)
    assert set(os.listdir("/proc/self/fd")) == before


def test_read_regular_takes_a_file_of_exactly_the_limit(tmp_path):
    from engine.io import read_regular

    path = tmp_path / "f.bin"
    path.write_bytes(b"abcd")
    assert read_regular(path, 4) == b"abcd"
    with pytest.raises(ValueError, match="has 4 bytes, above the limit of 3"):
        read_regular(path, 3)


@pytest.mark.parametrize("confine", [False, True])
@pytest.mark.parametrize("rel, words", [("/etc/passwd", "absolute path refused"), ("\\\\server\\x", "absolute path refused"),
                                        ("\\x.JPEG", "absolute path refused"), ("a\x00b.JPEG", "NUL byte in path"),
                                        ("", "empty path"), ("a/../b.JPEG", "'..' component refused")])
def test_resolve_relative_refuses_before_touching_the_filesystem(tmp_path, rel, words, confine):
    from engine.io import resolve_relative

    with pytest.raises(ValueError, match=words):
        resolve_relative(tmp_path, rel, "IMAGE_ROOT", confine)
    assert resolve_relative(tmp_path, "a/b.JPEG") == str(tmp_path / "a" / "b.JPEG")


@pytest.mark.parametrize("rel, words", [("/etc/passwd", "absolute path refused"), ("\\x.JPEG", "absolute path refused"),
                                        ("a\x00b.JPEG", "NUL byte in path"), ("../x.JPEG", "path escapes IMAGE_ROOT")])
def test_resolve_inside_refuses_on_its_own(tmp_path, rel, words):
    """resolve_inside is called directly too (not only after resolve_relative's checks)."""
    from engine.io import resolve_inside

    with pytest.raises(ValueError, match=words):
        resolve_inside(tmp_path, rel, "IMAGE_ROOT")
    assert resolve_inside(tmp_path, "a.JPEG") == str(tmp_path.resolve() / "a.JPEG")
