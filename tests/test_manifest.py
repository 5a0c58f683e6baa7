"""evaluator.contest.manifest: the row parser (rows as Python's text reading counts them) and the
path rules in front of every image read (trusted staging by default, confinement on request)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from evaluator.contest.manifest import ManifestError, Row, parse_manifest, read_manifest, resolve_image


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


@pytest.mark.parametrize("trailing", [True, False])
def test_cr_only_line_endings_are_rows(tmp_path, trailing):
    # classic Mac line ends: Python's `for line in open(path)` sees one row per CR
    text = "\r".join(f"{r.request_id}\tdir/{i:02d}.JPEG" for i, r in enumerate(ROWS * 4)) + ("\r" if trailing else "")
    rows = read_manifest(_write(tmp_path, text.encode()))
    assert [r.path for r in rows] == [f"dir/{i:02d}.JPEG" for i in range(12)]
    assert [r.line for r in rows] == list(range(1, 13))


MANIFESTS = [
    b"a\tx\rb\ty\r\nc\tz\n",
    b"a\tx\r\rb\ty\n\r\n\r",                 # blank lines made of each line end
    b"a\tx\n \t \n\tnoid\nnopath\t\n\n",
    b"a\tx\x0by\x0c\x1c\xc2\x85\nb\tu\xe2\x80\xa8v\n",   # separators of str.splitlines, not of open()
    b"\n\n\na\tx",
    b"",
    b"\r\n",
]


@pytest.mark.parametrize("data", MANIFESTS)
def test_rows_are_the_non_blank_lines_python_reads(tmp_path, data):
    """The reference's own reading (`for line in open(path)`) is the definition of a row."""
    p = _write(tmp_path, data)
    with open(p, encoding="utf-8") as f:
        want = [line.rstrip("\n") for line in f]
    m = parse_manifest(p)
    assert [f"{r.request_id}\t{r.path}" for r in m.rows] == [w for w in want if w.strip()]
    assert [r.line for r in m.rows] == [no for no, w in enumerate(want, 1) if w.strip()]
    assert m.blank == [no for no, w in enumerate(want, 1) if not w.strip()]


def test_blank_lines_are_skipped_and_named_not_rows(tmp_path):
    p = _write(tmp_path, b"a1\timages/00/x.JPEG\n\nb2\timages/01/y.JPEG\n   \r\nc3\tz.png\n")
    m = parse_manifest(p)
    assert [(r.request_id, r.path) for r in m.rows] == [(r.request_id, r.path) for r in ROWS]
    assert [r.line for r in m.rows] == [1, 3, 5] and m.blank == [2, 4]


@pytest.mark.parametrize("blanks", [0, 1, 10, 11, 13])
def test_blank_notes_name_the_first_ten_then_count_the_rest(tmp_path, blanks):
    p = tmp_path / "m.tsv"
    p.write_bytes(b"a\tx\n" + b"\n" * blanks + b"b\ty\n")
    m = parse_manifest(p)
    named = [f"{p}:{no}: blank line skipped (not a row)" for no in range(2, 2 + min(blanks, 10))]
    rest = [f"{p}: {blanks - 10} more blank lines skipped"] if blanks > 10 else []
    assert m.path == str(p) and m.blank_notes() == named + rest
    assert m.blank_notes(most=1) == named[:1] + ([f"{p}: {blanks - 1} more blank lines skipped"] if blanks > 1 else [])


@pytest.mark.parametrize("tail", [b"\n", b"\n\n", b"\r\n\r\n", b"\r\r\r", b"\n \n\t\n"])
def test_trailing_blank_lines_are_reported_and_never_rows(tmp_path, tail):
    body = "\n".join(f"{r.request_id}\t{r.path}" for r in ROWS).encode()
    m = parse_manifest(_write(tmp_path, body + b"\n" + tail))
    assert m.rows == ROWS
    extra = tail.replace(b"\r\n", b"\n").replace(b"\r", b"\n").count(b"\n")   # one blank line per line end
    assert m.blank == list(range(4, 4 + extra))


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
    (b"a\tx.jpg\n\nb y.jpg\n", 3),            # the blank line 2 is skipped but still counted as a line
    (b"a\tx.jpg\r\nb\ty.jpg\r\nlast\r\n", 3),
    (b"a\tx.jpg\rb\ty.jpg\rlast\r", 3),
])
def test_line_without_tab_names_the_line(tmp_path, data, line):
    p = _write(tmp_path, data)
    with pytest.raises(ManifestError, match=f"{p}:{line}: expected request_id<TAB>path"):
        read_manifest(p)


def test_empty_fields_are_rows_not_errors(tmp_path):
    # the request id is not part of the output; an empty path is a row nothing can open (the run
    # answers it and says so), as the reference would fail to open it
    p = _write(tmp_path, b"\tx.jpg\nb\t\r\nc\ty.jpg\n")
    assert read_manifest(p) == [Row("", "x.jpg", 1), Row("b", "", 2), Row("c", "y.jpg", 3)]
    with pytest.raises(ValueError, match="empty path"):
        resolve_image(tmp_path, "")


@pytest.mark.parametrize("data, line", [(b"a\tx.jpg\nb\ty.jpg\nc\t\xff\xfe.jpg\n", 3),
                                        (b"a\tx.jpg\rb\ty.jpg\r\n\rc\t\xff.jpg\n", 4),
                                        (b"\xff\n", 1)])
def test_invalid_utf8_names_the_line(tmp_path, data, line):
    p = _write(tmp_path, data)
    with pytest.raises(ManifestError, match=f"{p}:{line}: not valid UTF-8"):
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
    for confine in (False, True):
        assert resolve_image(root, "images/00/a.jpg", confine) == want
        assert resolve_image(root, "./images/00/a.jpg", confine) == want
        assert resolve_image(root, "images//00/./a.jpg", confine) == want


def test_missing_file_inside_the_root_is_not_refused(root):
    # existence is the reader's concern: the rules only refuse what a path says
    assert resolve_image(root, "images/00/nope.jpg") == _real(root) / "images" / "00" / "nope.jpg"


@pytest.mark.parametrize("confine", [False, True])
@pytest.mark.parametrize("rel", ["/etc/passwd", "//etc/passwd", "\\windows\\x.jpg"])
def test_absolute_path_refused(root, rel, confine):
    with pytest.raises(ValueError, match="absolute path refused"):
        resolve_image(root, rel, confine)


def test_absolute_path_to_an_inside_file_is_refused_too(root):
    with pytest.raises(ValueError, match="absolute"):
        resolve_image(root, str(root / "images" / "00" / "a.jpg"))


@pytest.mark.parametrize("confine", [False, True])
@pytest.mark.parametrize("rel", ["../secret.jpg", "a/../../secret.jpg", "images/00/../../../secret.jpg", "..",
                                 "images/00/../00/a.jpg", "images/..", "../root_evil/x.jpg"])
def test_dotdot_component_refused_even_when_it_stays_inside(root, rel, confine):
    with pytest.raises(ValueError, match="'..' component refused"):
        resolve_image(root, rel, confine)


@pytest.mark.parametrize("rel", ["images/..x.jpg", "images/x...jpg", "..hidden/a.jpg"])
def test_dots_inside_a_name_are_not_a_component(root, rel):
    assert resolve_image(root, rel) == _real(root) / rel


@pytest.mark.parametrize("rel", ["images/out_link.jpg", "images/out_dir/b.jpg"])
def test_symlink_out_of_the_root_is_followed_by_default(root, rel):
    # trusted staging: a symlink farm into a store elsewhere reads as the reference's open() does
    assert resolve_image(root, rel).read_bytes() == b"outside"


@pytest.mark.parametrize("rel", ["images/out_link.jpg", "images/out_dir/b.jpg"])
def test_symlink_out_of_the_root_refused_when_confined(root, rel):
    with pytest.raises(ValueError, match="escapes IMAGE_ROOT"):
        resolve_image(root, rel, confine=True)


def test_confined_sibling_with_common_prefix_is_outside(root):
    # /tmp/x/root_evil shares a string prefix with /tmp/x/root: a path comparison, not a string one
    (root.parent / "root_evil").mkdir()
    (root.parent / "root_evil" / "x.jpg").write_bytes(b"x")
    os.symlink(root.parent / "root_evil", root / "evil")
    with pytest.raises(ValueError, match="escapes"):
        resolve_image(root, "evil/x.jpg", confine=True)
    assert resolve_image(root, "evil/x.jpg").read_bytes() == b"x"


@pytest.mark.parametrize("confine", [False, True])
def test_symlink_inside_the_root_allowed(root, confine):
    target = _real(root / "images" / "00" / "a.jpg")
    assert resolve_image(root, "images/in_link.jpg", confine) == target
    assert resolve_image(root, "images/rel_dir/a.jpg", confine) == target
    assert resolve_image(root, "images/in_link.jpg", confine).read_bytes() == b"inside"


@pytest.mark.parametrize("confine", [False, True])
def test_root_that_is_itself_a_symlink(root, tmp_path, confine):
    link = tmp_path / "root_link"
    os.symlink(root, link)
    assert resolve_image(link, "images/00/a.jpg", confine).read_bytes() == b"inside"
    with pytest.raises(ValueError, match="refused"):
        resolve_image(link, "../secret.jpg", confine)


@pytest.mark.parametrize("rel", ["images/00/a.jpg\x00.png", "\x00", "a\x00/../../secret.jpg"])
def test_nul_byte_refused(root, rel):
    with pytest.raises(ValueError, match="NUL byte"):
        resolve_image(root, rel)


def test_trusted_paths_are_joined_as_given_and_confined_ones_resolved(root):
    from engine.io import resolve_relative

    # trusted: nothing resolved (the open follows links); confined: the real path, links gone
    assert resolve_relative(root, "images/out_link.jpg") == os.path.join(root, "images/out_link.jpg")
    assert resolve_relative(root, "images/in_link.jpg", confine=True) == str(_real(root / "images/00/a.jpg"))
    assert resolve_relative(root, "images/in_link.jpg", confine=True, real_root=str(_real(root))) == \
        str(_real(root / "images/00/a.jpg"))
    with pytest.raises(ValueError, match="empty path"):
        resolve_relative(root, "", confine=True)


def test_the_reader_follows_a_final_symlink_only_when_asked(root, tmp_path):
    from engine.io import read_regular

    link = root / "images" / "out_link.jpg"
    assert read_regular(link, 100, follow=True) == b"outside"
    with pytest.raises(OSError):                       # ELOOP: O_NOFOLLOW met a final link
        read_regular(link, 100)
    assert read_regular(root / "images" / "00" / "a.jpg", 100) == b"inside"
    os.mkfifo(tmp_path / "fifo")
    (root / "to_fifo").symlink_to(tmp_path / "fifo")
    with pytest.raises(ValueError, match="a FIFO, not a regular file"):   # followed, still checked, no hang
        read_regular(root / "to_fifo", 100, follow=True)
    with pytest.raises(ValueError, match="7 bytes, above the limit of 6"):
        read_regular(link, 6, follow=True)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_manifest_that_is_not_a_regular_file_is_an_error_not_a_hang(tmp_path, kind):
    import os

    p = tmp_path / "manifest.tsv"
    os.mkfifo(p) if kind == "fifo" else p.mkdir()
    with pytest.raises(ManifestError, match=f"a {'FIFO' if kind == 'fifo' else 'directory'}, not a regular file"):
        read_manifest(p)
