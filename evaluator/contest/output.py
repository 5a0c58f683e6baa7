"""OUTPUT of a contest run: refused when it is an input or a special file, reserved before any
image is read, committed atomically.

Rules, in order (all before the first image is read):
1. Refused, nothing deleted: OUTPUT that is (or resolves to, through symlinks or a hard
   link) the manifest, anything under IMAGE_ROOT's real path, anything in the artifact
   directory, or an existing file that is not a regular one (a directory, a character
   device such as /dev/null, a FIFO, a socket, /proc/self/fd/1's pipe or terminal).
2. A temp file `.tmp-NAME-<time><random>` is created beside OUTPUT with O_EXCL and held under an
   flock while this run lives (engine.io.create_locked_temp). Temp files of runs that are gone
   (their lock can be taken) are removed; one still held by an earlier live run means another
   run is writing this OUTPUT now: that run wins, this one stops with one line (OutputError)
   and deletes nothing but its own temp file. Otherwise a stale regular OUTPUT is removed (a
   file from an earlier run must never pass for this one's).
3. `reserve(n)` allocates the n bytes the answers take (posix_fallocate, else zeros), so a
   full disk or a file-size limit is one error before the model loads.
4. `commit(data)` writes, fsyncs and renames the temp file onto OUTPUT, the lock held until the
   rename is done; `discard()` removes it on every other exit path. OUTPUT is thus absent or one
   whole run's answer: should two runs both get this far, the last rename wins, whole.
A symlink OUTPUT is written through (its target is what rules 1-4 apply to), as
`open(OUTPUT, "wb")` would. When OUTPUT's folder is not writable but OUTPUT itself is, it is
emptied at step 2 (under OUTPUT's own flock: a second run in place stops) and written in place.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from engine.io import create_locked_temp, file_kind, open_locked, remove_abandoned, same_inode, temp_prefix

_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)   # the filesystem cannot: write zeros instead


class OutputError(Exception):
    """OUTPUT cannot be used; the message says why (scripts/run prints it as its one error line)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True          # someone else's process: leave its files alone
    return True


def stale(name: str, prefix: str) -> bool:
    """`name` is PREFIX<pid> of a process that no longer runs."""
    tail = name[len(prefix):]
    return name.startswith(prefix) and tail.isdigit() and int(tail) != os.getpid() and not _alive(int(tail))


def _first_born(paths: list[Path]) -> Path:
    """The temp file made first: its name starts with its creation time, fixed width, so every run
    finds the same one (engine.io.create_locked_temp)."""
    return min(paths, key=lambda p: p.name)


def _under(path: str, folder: str) -> bool:
    return os.path.commonpath([folder, path]) == folder


def _same_file(st: os.stat_result, other: os.stat_result) -> bool:
    return (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino)


def _artifact_files(artifact: str):
    """stat of each file in the artifact directory (a handful of files)."""
    for dirpath, _, names in os.walk(artifact):
        for n in names:
            try:
                yield os.stat(os.path.join(dirpath, n))
            except OSError:
                pass


def refusal(path: Path, manifest: Path | None = None, image_root: Path | None = None,
            artifact: Path | None = None) -> str | None:
    """Why OUTPUT must not be written (rule 1), or None."""
    real = os.path.realpath(path)
    try:
        st = os.stat(path)            # follows links: /proc/self/fd/1 is the pipe it names
    except OSError:
        st = None                     # absent (or a dangling link): nothing to protect
    if st is not None and not stat.S_ISREG(st.st_mode):
        pipe = " (or pipe)" if stat.S_ISFIFO(st.st_mode) else ""   # /proc/self/fd/1 of a pipe is one
        return f"OUTPUT is {file_kind(st.st_mode)}{pipe}, not a regular file: {path}"
    if manifest is not None:
        try:
            same = st is not None and _same_file(st, os.stat(manifest))
        except OSError:
            same = False
        if same or real == os.path.realpath(manifest):
            return f"OUTPUT is the manifest: {path}"
    if image_root is not None and _under(real, os.path.realpath(image_root)):
        return f"OUTPUT is inside IMAGE_ROOT ({image_root}): {path}"
    if artifact is not None and os.path.isdir(artifact):
        real_art = os.path.realpath(artifact)
        if _under(real, real_art) or (st is not None and any(_same_file(st, f) for f in _artifact_files(real_art))):
            return f"OUTPUT is a file of the artifact {artifact}: {path}"
    return None


class Output:
    """OUTPUT, checked and reserved before any image is read (the module's rules 1-4)."""

    def __init__(self, path: Path, manifest: Path | None = None, image_root: Path | None = None,
                 artifact: Path | None = None):
        why = refusal(path, manifest, image_root, artifact)
        if why:
            raise OutputError(why)
        path = Path(os.path.realpath(path))   # a link is written through, as open(OUTPUT, "wb") would
        self.path, self.fd, self.tmp, self.done = path, None, None, False
        folder = path.parent
        if not os.path.isdir(folder):
            raise OutputError(f"OUTPUT folder does not exist (or is not reachable): {folder}")
        try:
            self.fd, self.tmp = create_locked_temp(path)
        except OSError as e:
            self._in_place(folder, e)
            return
        live = remove_abandoned(folder, temp_prefix(path), keep=self.tmp)   # temp files of killed runs go
        first = _first_born([self.tmp, *live])
        if first != self.tmp:   # an earlier run still writes this OUTPUT: it wins, this one stops here
            self.discard()
            raise OutputError(f"another run is writing OUTPUT now (its temp file {first.name} is held by a live "
                              f"process); this run stops and leaves OUTPUT to it: {path}")
        try:
            if os.path.lexists(path):
                os.unlink(path)   # a stale OUTPUT must never pass for this run's
        except OSError as e:      # not ours to remove (a sticky folder): write it in place
            self.discard()
            self.fd, self.tmp = None, None
            self._in_place(folder, e)

    def _in_place(self, folder: Path, e: OSError) -> None:
        """No temp file can be made in OUTPUT's folder: write OUTPUT itself, under its own flock
        (engine.io.open_locked, the lock scripts/run.sh holds on its output too)."""
        path = self.path
        if not (os.path.isfile(path) and os.access(path, os.W_OK)):
            raise OutputError(f"cannot write OUTPUT in {folder}: {e.strerror or e}") from None
        if os.stat(path).st_nlink > 1:   # emptying it in place would empty its other names too
            raise OutputError(f"cannot write OUTPUT in {folder} ({e.strerror or e}), and OUTPUT has other "
                              f"hard links: writing it in place would change them: {path}") from None
        try:
            self.fd, _ = open_locked(path, os.O_WRONLY)   # not O_TRUNC: another writer may hold it
        except BlockingIOError:
            raise OutputError(f"another run is writing OUTPUT in place now (it holds its lock); this run stops "
                              f"and leaves OUTPUT to it: {path}") from None
        except OSError as e2:   # (a filesystem without flock: written unguarded, as a temp file there is)
            raise OutputError(f"cannot write OUTPUT {path}: {e2.strerror or e2}") from None
        os.ftruncate(self.fd, 0)   # emptied now, written at the end

    def reserve(self, nbytes: int) -> None:
        """Allocate `nbytes` now: no space (or a file-size limit) is an OutputError before any work."""
        if nbytes <= 0:
            return
        try:
            try:
                os.posix_fallocate(self.fd, 0, nbytes)
            except OSError as e:
                if e.errno not in _NO_FALLOCATE:
                    raise
                zeros = memoryview(bytes(min(nbytes, 1 << 20)))
                left = nbytes
                while left:
                    left -= os.write(self.fd, zeros[: min(left, len(zeros))])
                os.fsync(self.fd)
                os.lseek(self.fd, 0, os.SEEK_SET)
        except OSError as e:
            where = self.tmp or self.path
            raise OutputError(f"cannot reserve {nbytes} bytes for OUTPUT at {where}: {e.strerror or e}") from None

    def commit(self, data: bytes) -> None:
        """Write `data` from the start, trim, fsync, and rename the temp file onto OUTPUT (its lock
        held until the rename is done: no cleaner can take it for abandoned in between)."""
        os.lseek(self.fd, 0, os.SEEK_SET)
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        os.ftruncate(self.fd, len(data))   # a reservation larger than the answers leaves no tail
        os.fsync(self.fd)
        if self.tmp is not None:
            if not same_inode(self.fd, self.tmp):
                raise OutputError(f"the temp file {self.tmp} is no longer this run's (removed or replaced "
                                  "by another process): OUTPUT not written")
            os.replace(self.tmp, self.path)
        os.close(self.fd)
        self.fd = None
        self.done = True

    def discard(self) -> None:
        """Close and remove the temp file (every exit path that did not commit); a name that no
        longer is this run's file (removed and made again by another process) is left alone."""
        ours = not self.done and self.tmp is not None and self.fd is not None and same_inode(self.fd, self.tmp)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if ours:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass

