"""File helpers every part of the kit shares: one copy each.

sha256 of a file, an atomic write (a crash never leaves a file that looks complete),
and the installed versions of named packages.
"""
from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same folder, fsync, rename."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def package_versions(packages, missing: bool = True) -> dict[str, str | None]:
    """{"python", "machine", package: version} for `packages`; an absent one is None
    (or left out with missing=False). Nothing is imported: importlib.metadata only."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version(), "machine": platform.machine()}
    for pkg in packages:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            if missing:
                out[pkg] = None
    return out
