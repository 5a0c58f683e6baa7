"""evaluator.contest.manifest: the row parser and the path guard in front of every image read."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from evaluator.contest.manifest import ManifestError, Row, read_manifest, resolve_image


def _write(tmp_path: Path, data: bytes, name: str = "manifest.tsv") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


ROWS = [Row("a1", "images/00/x.JPEG", 1), Row("b2", "images/01/y.JPEG", 2), Row("c3", "z.png", 3)]


@pytest.mark.parametrize("eol", ["\n", "\r\n"])
@pytest.mark.parametrize("trailing", [True, False])
def test_line_endings_and_trailing_newline(tmp_path, eol, trailing):
    text = eol.join(f"{r.request_id}\t{r.path}" for r in ROWS) + (eol if trailing else "")
    assert read_manifest(_write(tmp_path, text.encode())) == ROWS


def test_mixed_line_endings(tmp_path):
    p = _write(tmp_path, b"a1\timages/00/x.JPEG\r\nb2\timages/01/y.JPEG\nc3\tz.png\r\n")
    assert read_manifest(p) == ROWS


def test_empty_manifest_has_no_rows(tmp_path):
    assert read_manifest(_write(tmp_path, b"")) == []


def test_request_ids_with_spaces_and_unicode(tmp_path):
    p = _write(tmp_path, "req 1 with spaces\ta.jpg\n  padded  \tb.jpg\n\u00e9t\u00e9 \u2603\tdir/\u00fc.jpg\n".encode())
    assert read_manifest(p) == [Row("req 1 with spaces", "a.jpg", 1), Row("  padded  ", "b.jpg", 2),
                                Row("\u00e9t\u00e9 \u2603", "dir/\u00fc.jpg", 3)]


def test_tab_after_the_first_stays_in_the_path(tmp_path):
    p = _write(tmp_path, b"id1\tdir/with\ttab.jpg\r\nid2\ta b\tc\td.jpg\n")
    assert read_manifest(p) == [Row("id1", "dir/with\ttab.jpg", 1), Row("id2", "a b\tc\td.jpg", 2)]


@pytest.mark.parametrize("data, line", [
    (b"no tab here\n", 1),
    (b"a\tx.jpg\nb x.jpg\n", 2),
    (b"a\tx.jpg\n\nb\ty.jpg\n", 2),          # a blank line in the middle is malformed
    (b"a\tx.jpg\r\nb\ty.jpg\r\nlast\r\n", 3),
])
def test_line_without_tab_names_the_line(tmp_path, data, line):
    p = _write(tmp_path, data)
    with pytest.raises(ManifestError, match=f"{p}:{line}: expected request_id<TAB>path"):
        read_manifest(p)


@pytest.mark.parametrize("data, line", [
    (b"\tx.jpg\n", 1),
    (b"a\tx.jpg\nb\t\n", 2),
    (b"a\tx.jpg\r\nb\t\r\n", 2),
])
def test_empty_request_id_or_path(tmp_path, data, line):
    p = _write(tmp_path, data)
    with pytest.raises(ManifestError, match=f":{line}: empty request id or path"):
        read_manifest(p)


def test_invalid_utf8_names_the_line(tmp_path):
    p = _write(tmp_path, b"a\tx.jpg\nb\ty.jpg\nc\t\xff\xfe.jpg\n")
    with pytest.raises(ManifestError, match=f"{p}:3: not valid UTF-8"):
        read_manifest(p)


def test_manifest_error_is_a_value_error(tmp_path):
    with pytest.raises(ValueError):
        read_manifest(_write(tmp_path, b"x\n"))


def test_unreadable_manifest(tmp_path):
    with pytest.raises(ManifestError, match="cannot read manifest .*missing.tsv"):
        read_manifest(tmp_path / "missing.tsv")
    with pytest.raises(ManifestError, match="cannot read manifest"):
        read_manifest(tmp_path)  # a directory


@pytest.fixture
def root(tmp_path) -> Path:
    """IMAGE_ROOT with one image inside, one secret outside, and links both ways."""
    r = tmp_path / "root"
    (r / "images" / "00").mkdir(parents=True)
    (r / "images" / "00" / "a.jpg").write_bytes(b"inside")
    (tmp_path / "secret.jpg").write_bytes(b"outside")
    (tmp_path / "outdir").mkdir()
    (tmp_path / "outdir" / "b.jpg").write_bytes(b"outside")
    os.symlink(tmp_path / "secret.jpg", r / "images" / "out_link.jpg")
    os.symlink(tmp_path / "outdir", r / "images" / "out_dir")
    os.symlink(r / "images" / "00" / "a.jpg", r / "images" / "in_link.jpg")
    os.symlink("00", r / "images" / "rel_dir")  # a relative link inside the root
    return r


def _real(p: Path) -> Path:
    return Path(os.path.realpath(p))  # tmp_path may sit under a symlink (/tmp -> /private/tmp)


def test_plain_relative_path(root):
    want = _real(root / "images" / "00" / "a.jpg")
    assert resolve_image(root, "images/00/a.jpg") == want
    assert resolve_image(root, "images/00/../00/a.jpg") == want
    assert resolve_image(root, "./images/00/a.jpg") == want


def test_missing_file_inside_the_root_is_not_refused(root):
    # existence is the reader's concern: the guard only refuses escapes
    assert resolve_image(root, "images/00/nope.jpg") == _real(root) / "images" / "00" / "nope.jpg"


@pytest.mark.parametrize("rel", ["/etc/passwd", "//etc/passwd", "\\windows\\x.jpg"])
def test_absolute_path_refused(root, rel):
    with pytest.raises(ValueError, match="absolute path refused"):
        resolve_image(root, rel)


def test_absolute_path_to_an_inside_file_is_refused_too(root):
    with pytest.raises(ValueError, match="absolute"):
        resolve_image(root, str(root / "images" / "00" / "a.jpg"))


@pytest.mark.parametrize("rel", ["../secret.jpg", "a/../../secret.jpg", "images/00/../../../secret.jpg", "..",
                                 "images/../../root_sibling/x.jpg"])
def test_dotdot_escape_refused(root, rel):
    with pytest.raises(ValueError, match="escapes IMAGE_ROOT"):
        resolve_image(root, rel)


def test_sibling_with_common_prefix_is_outside(root):
    # /tmp/x/root_evil shares a string prefix with /tmp/x/root: a path comparison, not a string one
    (root.parent / "root_evil").mkdir()
    (root.parent / "root_evil" / "x.jpg").write_bytes(b"x")
    with pytest.raises(ValueError, match="escapes"):
        resolve_image(root, "../root_evil/x.jpg")


@pytest.mark.parametrize("rel", ["images/out_link.jpg", "images/out_dir/b.jpg"])
def test_symlink_out_of_the_root_refused(root, rel):
    with pytest.raises(ValueError, match="escapes IMAGE_ROOT"):
        resolve_image(root, rel)


def test_symlink_inside_the_root_allowed(root):
    target = _real(root / "images" / "00" / "a.jpg")
    assert resolve_image(root, "images/in_link.jpg") == target
    assert resolve_image(root, "images/rel_dir/a.jpg") == target
    assert resolve_image(root, "images/in_link.jpg").read_bytes() == b"inside"


def test_root_that_is_itself_a_symlink(root, tmp_path):
    link = tmp_path / "root_link"
    os.symlink(root, link)
    assert resolve_image(link, "images/00/a.jpg").read_bytes() == b"inside"
    with pytest.raises(ValueError, match="escapes"):
        resolve_image(link, "../secret.jpg")


@pytest.mark.parametrize("rel", ["images/00/a.jpg\x00.png", "\x00", "a\x00/../../secret.jpg"])
def test_nul_byte_refused(root, rel):
    with pytest.raises(ValueError, match="NUL byte"):
        resolve_image(root, rel)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_manifest_that_is_not_a_regular_file_is_an_error_not_a_hang(tmp_path, kind):
    import os

    p = tmp_path / "manifest.tsv"
    os.mkfifo(p) if kind == "fifo" else p.mkdir()
    with pytest.raises(ManifestError, match=f"a {'FIFO' if kind == 'fifo' else 'directory'}, not a regular file"):
        read_manifest(p)
