"""The contest manifest: one `request_id<TAB>relative/path` row per image, in output order.

The manifest is read like every input: a regular file only (a FIFO or a directory is an
error, never a hang), at most MAX_BYTES.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MAX_BYTES = 1 << 30   # 10,000 rows take ~0.5 MB: anything near this is not a manifest


class ManifestError(ValueError):
    """The manifest cannot be parsed; the message names the line."""


@dataclass(frozen=True)
class Row:
    request_id: str
    path: str
    line: int


def read_manifest(path: str | os.PathLike) -> list[Row]:
    """Rows of a manifest. CRLF and a trailing newline are fine; anything else malformed is an error."""
    from engine.pipeline import read_regular

    try:
        data = read_regular(path, MAX_BYTES, "the manifest limit")
    except OSError as e:
        raise ManifestError(f"cannot read manifest {path}: {e.strerror or e}") from e
    except ValueError as e:
        raise ManifestError(f"cannot read manifest: {e}") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ManifestError(f"{path}:{line}: not valid UTF-8") from e
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # trailing newline
    rows = []
    for no, raw in enumerate(lines, 1):
        line = raw[:-1] if raw.endswith("\r") else raw
        if "\t" not in line:
            raise ManifestError(f"{path}:{no}: expected request_id<TAB>path, found no tab: {line[:80]!r}")
        rid, rel = line.split("\t", 1)
        if not rid or not rel:
            raise ManifestError(f"{path}:{no}: empty request id or path")
        rows.append(Row(rid, rel, no))
    return rows


def resolve_image(root: Path, rel: str) -> Path:
    """Path of `rel` inside `root`; raises ValueError (never opening anything) if it escapes the root."""
    from engine.pipeline import resolve_inside

    return Path(resolve_inside(root, rel, "IMAGE_ROOT"))
