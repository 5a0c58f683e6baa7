"""The contest manifest: one `request_id<TAB>relative/path` row per image, in output order.

Rows are counted as Python's own text reading counts them (`for line in open(path)`,
universal newlines): `\\n`, `\\r\\n` and `\\r` each end a row. A blank (or whitespace-only)
line is not a row, for the reference either: it is skipped and its line number kept, so
the caller can say so. A line without a tab, or bytes that are not UTF-8, refuse the
whole manifest (the line is named). Empty fields are not a parse error: an empty path is
a row the reader cannot open (a prediction and a stderr line), and the request id is not
part of the output.

The manifest is read like every input: a regular file only (a FIFO or a directory is an
error, never a hang), at most MAX_BYTES.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.io import read_regular, resolve_relative

MAX_BYTES = 1 << 30   # 10,000 rows take ~0.5 MB: anything near this is not a manifest


class ManifestError(ValueError):
    """The manifest cannot be parsed; the message names the line."""


@dataclass(frozen=True)
class Row:
    request_id: str
    path: str
    line: int


@dataclass(frozen=True)
class Manifest:
    rows: list[Row]
    path: str = ""
    blank: list[int] = field(default_factory=list)   # line numbers of skipped blank lines

    def blank_notes(self, most: int = 10) -> list[str]:
        """One line per skipped blank line (the first `most`, then a count), for stderr."""
        notes = [f"{self.path}:{no}: blank line skipped (not a row)" for no in self.blank[:most]]
        if len(self.blank) > most:
            notes.append(f"{self.path}: {len(self.blank) - most} more blank lines skipped")
        return notes


def _lines(text: str) -> list[str]:
    """Lines as universal newlines split them (only \\n, \\r\\n, \\r; not str.splitlines' others)."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines[-1] == "":
        lines.pop()  # the last line's end, or an empty file
    return lines


def parse_manifest(path: str | os.PathLike) -> Manifest:
    """Rows of a manifest and the blank lines skipped; ManifestError when it cannot be used."""
    try:
        data = read_regular(path, MAX_BYTES, "the manifest limit")
    except OSError as e:
        raise ManifestError(f"cannot read manifest {path}: {e.strerror or e}") from e
    except ValueError as e:
        raise ManifestError(f"cannot read manifest: {e}") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = len(_lines(data[: e.start].decode("utf-8") + "x"))
        raise ManifestError(f"{path}:{line}: not valid UTF-8") from e
    rows, blank = [], []
    for no, line in enumerate(_lines(text), 1):
        if not line.strip():
            blank.append(no)
            continue
        if "\t" not in line:
            raise ManifestError(f"{path}:{no}: expected request_id<TAB>path, found no tab: {line[:80]!r}")
        rid, rel = line.split("\t", 1)
        rows.append(Row(rid, rel, no))
    return Manifest(rows, os.fspath(path), blank)


def read_manifest(path: str | os.PathLike) -> list[Row]:
    """The rows of a manifest (blank lines skipped); ManifestError when it cannot be used."""
    return parse_manifest(path).rows


def resolve_image(root: Path, rel: str, confine: bool = False) -> Path:
    """Real path of the image `rel` names under `root` (symlinks followed, or confined to the
    root's real path when `confine`); ValueError, nothing opened, for an empty or absolute path,
    a NUL byte or a `..` component (engine.io.resolve_relative)."""
    return Path(os.path.realpath(resolve_relative(root, rel, "IMAGE_ROOT", confine)))
