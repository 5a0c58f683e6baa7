"""The search's disk: a work folder whose size is watched and whose free space is checked.

Every compiled candidate writes its files (and, for an Inductor compile, its own Inductor cache)
under the search's work folder, so a loser's files can be removed when it loses and the whole
folder when the build ends. Before each compile the free space there is checked against what
one compile needs: the largest growth a compile of this search caused, or before any, a first
estimate (about three times the weights' bytes: the compiled object holds the weights once, its
constants object once more, plus code). The folder's size is sampled after each compile; its
peak is what the manifest records, beside the peak growth of the used bytes of the file system
holding TMPDIR (what a compile still writes there: Triton's cache, a library's scratch; on a
shared file system other writers count too).
"""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from engine.io import tree_bytes

GiB = 2 ** 30


def free_bytes(path: Path) -> int:
    """Free bytes on the file system holding `path`."""
    return shutil.disk_usage(path).free


def used_bytes(path: Path) -> int:
    """Used bytes on the file system holding `path` (0 when it cannot be read)."""
    try:
        return shutil.disk_usage(path).used
    except OSError:
        return 0


class WorkDisk:
    """The work folder's size before and after each compile, and whether one more fits.
    `free` and `size` are injectable (tests simulate a quota)."""

    def __init__(self, folder: Path, first_need: int, free: Callable[[Path], int] | None = None,
                 size: Callable[[Path], int] | None = None, tmpdir: Path | None = None,
                 used: Callable[[Path], int] = used_bytes):
        import tempfile

        self.folder, self.first_need = Path(folder), int(first_need)
        self.tmpdir = Path(tmpdir if tmpdir is not None else tempfile.gettempdir())
        self._used = used
        self._tmp_start = used(self.tmpdir)
        self.tmpdir_peak = 0      # the largest growth of TMPDIR's file system's used bytes, after each compile
        self._free = free if free is not None else free_bytes
        self._size = size if size is not None else tree_bytes
        self.largest = 0          # the largest growth of the folder over one compile
        self.peak = 0             # the largest size of the folder, sampled after each compile
        self.skipped = 0
        self._before = 0

    def need(self) -> int:
        return self.largest or self.first_need

    def fits(self) -> str | None:
        """None when one more compile fits in the free space, else why not (one line)."""
        free, need = self._free(self.folder), self.need()
        if free >= need:
            return None
        self.skipped += 1
        return (f"needs about {need / GiB:.2f} GiB on disk ({'the largest compile so far' if self.largest else 'a first estimate'}), "
                f"{free / GiB:.2f} GiB free in {self.folder}")

    def before(self) -> None:
        self._before = self._size(self.folder)

    def after(self) -> None:
        size = self._size(self.folder)
        self.largest = max(self.largest, size - self._before)
        self.peak = max(self.peak, size)
        self.tmpdir_peak = max(self.tmpdir_peak, self._used(self.tmpdir) - self._tmp_start)

    def record(self) -> dict:
        return {"peak_bytes": self.peak, "largest_compile_bytes": self.largest, "first_estimate_bytes": self.first_need,
                "skipped_for_space": self.skipped, "tmpdir": str(self.tmpdir),
                "tmpdir_peak_growth_bytes": self.tmpdir_peak,
                "measured": "size of the search's work folder (candidates' files and their Inductor caches), "
                            "sampled after each compile"}
