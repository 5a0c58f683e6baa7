"""File access every part of the kit shares: one copy each.

Reading an input: `read_regular` (a regular file of bounded size, never a FIFO or a device),
`resolve_relative` / `resolve_inside` (a manifest's relative path, followed or confined to
its root). Also: what kind of file a mode names, the bytes under a folder, the sha256 of a
file, sharing a written tree as its root folder is shared, locked temp files (created under a random name, removed only when their owner is gone),
a file opened under an exclusive lock of its own (`open_locked`: one writer at a time),
an atomic write (a crash never leaves a file that looks complete), and the installed
versions of named packages.

Folders a command writes: `folder_refusal` says why a path must not be written or replaced (an
empty path, `.`, the current directory, the project or a folder above either, a file, a folder
holding an input, a non-empty folder this kit did not make); `mark_owned` / `marked` put and read
the kit's mark; `make_owned_temp` makes a temp folder held under its maker's flock, and
`sweep_abandoned` removes those whose maker is gone, however it died.
"""
from __future__ import annotations

import errno
import hashlib
import os
import platform
import stat
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is ("a directory", "a FIFO", ...), from its st_mode."""
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def read_regular(path: str | os.PathLike, max_bytes: int, limit: str = "ENGINE_MAX_FILE_BYTES",
                 follow: bool = False) -> bytes:
    """The bytes of a regular file of at most `max_bytes` (`limit` names that bound): one open,
    one fstat, one read.

    Opened non-blocking (a FIFO cannot hang the reader), following a final symlink only when
    `follow` (trusted staging: a symlink farm); directories, FIFOs, sockets and devices are
    refused after the fstat, whatever a link led to, and an oversized file before a byte is
    read. Errors are OSError or ValueError naming why.
    """
    nofollow = 0 if follow else os.O_NOFOLLOW
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | nofollow | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is {file_kind(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise ValueError(f"{path} has {st.st_size} bytes, above the limit of {max_bytes} ({limit})")
        data = os.read(fd, st.st_size)
        while len(data) < st.st_size:  # a short read (rare for regular files): read the rest
            more = os.read(fd, st.st_size - len(data))
            if not more:
                break
            data += more
        return data
    finally:
        os.close(fd)


def resolve_relative(root: str | os.PathLike, rel: str, what: str = "the root", confine: bool = False,
                     real_root: str | None = None) -> str:
    """Where the relative path `rel` under `root` leads; ValueError (nothing opened) for an empty
    or absolute path, a NUL byte or a `..` component.

    Trusted staging (default): `root/rel` as given, to be opened following symlinks
    (read_regular(..., follow=True)), as `open(os.path.join(root, rel))` would: a symlink
    farm into a store elsewhere, or hard links, read like plain files. `confine=True`
    (untrusted inputs): the real path, which must stay inside root's real path
    (resolve_inside); open it without following (read_regular's default).
    """
    if not rel:
        raise ValueError("empty path")
    if os.path.isabs(rel) or rel.startswith(("/", "\\")):
        raise ValueError(f"absolute path refused: {rel!r}")
    if "\x00" in rel:
        raise ValueError("NUL byte in path")
    if ".." in rel.split("/"):
        raise ValueError(f"'..' component refused: {rel!r}")
    if confine:
        return resolve_inside(root, rel, what, real_root)   # realpath under the root, no final link
    return os.path.join(root, rel)


def resolve_inside(root: str | os.PathLike, rel: str, what: str = "the root", real_root: str | None = None) -> str:
    """Real path of `rel` inside `root`; ValueError (nothing opened) for an absolute path, a NUL
    byte or an escape, also through a symlink. `real_root`: os.path.realpath(root), if known."""
    if os.path.isabs(rel) or rel.startswith(("/", "\\")):
        raise ValueError(f"absolute path refused: {rel!r}")
    if "\x00" in rel:
        raise ValueError("NUL byte in path")
    real_root = real_root or os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, rel))  # follows symlinks: a link out of the root is refused
    if os.path.commonpath([real_root, real]) != real_root:
        raise ValueError(f"path escapes {what}: {rel!r}")
    return real


class FilesUnder:
    """`reader(i)`: the bytes of the i-th of the relative paths `rels` under `root`, as
    resolve_relative and read_regular give them: trusted (`confine` False: symlinks followed, as a
    staged symlink farm needs) or confined (the real path inside the root, no final link). `what`
    names the root in messages, `max_bytes` caps each file (ENGINE_MAX_FILE_BYTES)."""

    def __init__(self, root: str | os.PathLike, rels: list[str], what: str, confine: bool, max_bytes: int):
        self.root, self.rels, self.what, self.confine, self.max_bytes = root, rels, what, confine, max_bytes
        self.real_root = os.path.realpath(root)

    def __len__(self) -> int:
        return len(self.rels)

    def __call__(self, i: int) -> bytes:
        path = resolve_relative(self.root, self.rels[i], self.what, self.confine, self.real_root)
        return read_regular(path, self.max_bytes, follow=not self.confine)


def tree_bytes(root: str | os.PathLike, since: float | None = None) -> int:
    """Bytes of the files under `root` (only those modified at or after `since`, a time.time() value)."""
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                st = os.stat(os.path.join(dirpath, n))
            except OSError:
                continue
            if since is None or st.st_mtime >= since:
                total += st.st_size
    return total


def path_bytes(path: str | os.PathLike) -> int:
    """Bytes of a file, or of the files under a folder; 0 for a path that is not there."""
    try:
        if os.path.isfile(path):
            return os.path.getsize(path)
    except OSError:
        return 0
    return tree_bytes(path) if os.path.isdir(path) else 0


def share_tree_like_root(root: str | os.PathLike) -> None:
    """Give every folder under `root` root's mode and every regular file root's read bits (and its
    execute bits when the owner may execute it): a tree written under a private umask, or by a
    library that makes its files 0600, is then readable by whoever may read `root`. Links are
    left alone (their targets are not this tree's)."""
    mode = stat.S_IMODE(os.stat(root).st_mode)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISDIR(st.st_mode):
                os.chmod(p, mode)
            elif stat.S_ISREG(st.st_mode):
                m = stat.S_IMODE(st.st_mode) | (mode & 0o444)
                os.chmod(p, m | (mode & 0o111) if m & stat.S_IXUSR else m)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)   # flock unsupported there


def temp_prefix(path: str | os.PathLike) -> str:
    """The name prefix of `path`'s temp files in its folder: `.tmp-NAME-` (then creation time, random)."""
    return f".tmp-{Path(path).name}-"


def create_locked_temp(path: str | os.PathLike, mode: int = 0o644) -> tuple[int, Path]:
    """(fd, temp path) of a new, empty temp file beside `path`, created with O_EXCL and held under an
    exclusive flock for as long as the fd stays open: a live owner's temp file is never taken for an
    abandoned one (`remove_abandoned`), whatever its PID namespace. Its name is PREFIX, the creation
    time (16 hex digits of ns: names sort in creation order) and 8 random hex digits."""
    import fcntl
    import secrets
    import time

    path = Path(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    while True:
        tmp = path.with_name(f"{temp_prefix(path)}{time.time_ns():016x}{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, flags, mode)
        except FileExistsError:
            continue                                  # the name is taken: draw again
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)            # waits only while a cleaner holds it, then...
            if same_inode(fd, tmp):                  # ...the name must still be this file
                return fd, tmp
        except OSError as e:
            if e.errno in _NO_LOCKS:                  # a filesystem without flock: kept, never cleaned
                return fd, tmp
            os.close(fd)
            raise
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)                                  # a cleaner removed it in between: draw again


def open_locked(path: str | os.PathLike, flags: int, mode: int = 0o644) -> tuple[int, bool]:
    """(fd, locked): `path` opened with `flags` (never O_TRUNC: empty it once the lock is yours) and
    held under an exclusive flock, taken without waiting, for as long as the fd (or a dup of it)
    stays open. A lock dies with its process: a killed holder never blocks the next one.
    BlockingIOError naming `path` when another open file holds it (nothing changed, nothing left
    open). locked False: the filesystem has no flock (the caller says so, and goes on unguarded).
    The lock is on the file `path` names when it is taken (checked after: a name removed or
    replaced meanwhile is opened again)."""
    import fcntl

    while True:
        fd = os.open(path, flags | os.O_CLOEXEC, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            a, b = os.fstat(fd), os.stat(path)       # follows a link, as the open did
            if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
                return fd, True
        except OSError as e:
            if e.errno in _NO_LOCKS:
                return fd, False
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise BlockingIOError(e.errno, "held by another process writing it now", os.fspath(path)) from None
            if isinstance(e, FileNotFoundError):
                continue                             # removed between the open and the check: again
            raise
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)                                 # replaced meanwhile: lock the file the name holds now


def same_inode(fd: int, path: str | os.PathLike) -> bool:
    """Whether the name `path` (not followed) is the file open as `fd`."""
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def remove_abandoned(folder: str | os.PathLike, prefix: str, keep: Path | None = None) -> list[Path]:
    """Remove the temp files `folder/PREFIX*` whose owner is gone (their flock can be taken: a lock
    dies with its process); returns those still held by a live owner. `keep`: one's own."""
    import fcntl

    live = []
    try:
        names = sorted(p for p in Path(folder).iterdir() if p.name.startswith(prefix) and p != keep)
    except OSError:
        return live
    for p in names:
        try:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue                                  # gone, a link, or not ours to read: left alone
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                live.append(p)                        # its owner holds it: alive
            os.close(fd)                              # (no flock here: nothing is proven, left alone)
            continue
        try:
            if same_inode(fd, p):
                p.unlink()
        except OSError:
            pass                                      # not ours to remove (a sticky folder): left alone
        finally:
            os.close(fd)
    return live


def naming(e: OSError, path: str | os.PathLike) -> OSError:
    """`e`, or when it names no file (a write() that found the disk full), the same error naming
    `path`, the file being written: one-line messages then say where."""
    if e.filename is not None or e.errno is None:
        return e
    return type(e)(e.errno, e.strerror or os.strerror(e.errno), os.fspath(path))


def write_atomic(path: str | os.PathLike, data) -> None:
    """Write `data` (bytes, or a list of bytes-like parts written in order) to `path` through a
    locked temp file in the same folder, fsync, rename: two writers of one path never share a temp
    file, and the last rename wins with a whole file; a crash never leaves a file at `path` that
    looks complete. The one atomic writer of the kit (kernels/ is handed it)."""
    path = Path(path)
    fd, tmp = create_locked_temp(path)
    try:
        with open(fd, "wb", closefd=False) as f:
            for part in (data if isinstance(data, list) else [data]):
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise naming(e, path) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


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


# ------------------------------------------------------------------ folders a command writes
OWNED_MARK = ".eva-engine"   # in every folder a command of this kit made: one line, the folder's kind


def project_root() -> Path:
    """The checkout (or installed tree) this code runs from: engine/'s parent."""
    return Path(__file__).resolve().parent.parent


def _holds(folder: str, path: str) -> bool:
    """`folder` is `path` or one of its ancestors (both real paths)."""
    return os.path.commonpath([folder, path]) == folder


def mark_owned(folder: str | os.PathLike, kind: str) -> None:
    """Mark `folder` as made by this kit (`kind`: artifact, demo, index, ...): a later run may write into
    it or replace it; a folder without the mark (or another recognised sign) is never replaced."""
    write_atomic(Path(folder) / OWNED_MARK, f"{kind}\n".encode())


def marked(folder: str | os.PathLike, kind: str) -> bool:
    """`folder` carries this kit's mark for `kind` (mark_owned)."""
    try:
        return (Path(folder) / OWNED_MARK).read_text().strip() == kind
    except (OSError, UnicodeDecodeError):
        return False


def folder_refusal(path: str | os.PathLike, what: str, owned, inputs=()) -> str | None:
    """Why a command must not write (and perhaps replace) the folder `path` as `what`, or None.

    Refused, before anything is touched: an empty path or `.`; the current directory, the
    project this code runs from, or a folder holding either; an existing file (or anything
    that is not a folder); a non-empty folder that `owned(real_path)` does not recognise as one
    this kit made; a folder holding one of `inputs` (the files the command reads). An absent
    path or an empty folder is free. Symlinks are followed: the rule applies where they lead.
    """
    text = os.fspath(path)
    if text.strip() in ("", "."):
        return f"{what} path {text!r} is empty or '.': name a folder of its own"
    real = os.path.realpath(text)
    for name, other in (("the current directory", os.getcwd()), ("this project", str(project_root()))):
        if _holds(real, os.path.realpath(other)):
            same = "is" if real == os.path.realpath(other) else "holds"
            return f"{what} {text} {same} {name} ({other}): name a folder of its own"
    for i in inputs:
        if i is not None and _holds(real, os.path.realpath(i)):
            return f"{what} {text} holds an input of this command ({i}): name another folder"
    if not os.path.lexists(real):
        return None
    try:
        st = os.stat(real)
    except OSError as e:
        return f"{what} {text} cannot be examined: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{what} {text} is {'a file' if stat.S_ISREG(st.st_mode) else file_kind(st.st_mode)}, not a folder"
    try:
        empty = next(os.scandir(real), None) is None
    except OSError as e:
        return f"{what} {text} cannot be listed: {e.strerror or e}"
    if not empty and not owned(Path(real)):
        return (f"{what} {text} holds files this kit did not make (no {OWNED_MARK} mark or manifest of its "
                "own): nothing was changed; name another folder, or empty it yourself")
    return None


class LockHeld(RuntimeError):
    """Another live process holds the lock; `holder` is the pid it wrote there (or "unknown")."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is held by pid {holder}")
        self.path, self.holder = path, holder


def take_lock(path: str | os.PathLike) -> int:
    """The fd of the lock file `path` (created if absent) under an exclusive flock (open_locked),
    this pid written in it; closing the fd releases it, and so does the holder's death, however it
    dies. LockHeld, naming the pid written there, while a live process holds it. On a filesystem
    without flock the fd is returned unlocked (nothing can be proven there)."""
    path = Path(path)
    try:
        fd, _ = open_locked(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0))
    except BlockingIOError:
        try:
            holder = path.read_text(errors="replace").strip()[:32]
        except OSError:
            holder = ""
        raise LockHeld(path, holder or "unknown") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release_lock(fd: int, path: str | os.PathLike) -> None:
    """Remove the lock file `path` while still holding it, then release it (take_lock's other half)."""
    try:
        if same_inode(fd, path):
            os.unlink(path)
    except OSError:
        pass                              # not ours to remove (a sticky folder): the lock goes with the fd
    finally:
        os.close(fd)


OWNER = ".owner"   # in a temp folder: its lock file, flocked by the process that made it while it lives


def make_owned_temp(base: str | os.PathLike, prefix: str) -> tuple[Path, int]:
    """(a new folder base/PREFIX<random>, the fd holding its OWNER lock): while the fd is open the
    folder is its maker's; once the maker is gone (however it died) `owner_gone` says so and a sweep
    may remove it. Retried when a sweeper took the folder between the two steps."""
    import fcntl
    import tempfile

    while True:
        d = Path(tempfile.mkdtemp(prefix=prefix, dir=base))   # 0700, a name no other process has
        fd = os.open(d / OWNER, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            return d, fd                  # no flock on this filesystem: kept, and never swept
        if same_inode(fd, d / OWNER):
            return d, fd
        os.close(fd)                      # swept before the lock was taken: a new folder


def owner_gone(folder: str | os.PathLike) -> bool | None:
    """True when `folder`'s OWNER lock can be taken (its maker is gone), False while it is held,
    None when the folder has no OWNER file (nothing is proven)."""
    import fcntl

    try:
        fd = os.open(Path(folder) / OWNER, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False                      # its owner holds it (or no flock here): alive, left alone
    finally:
        os.close(fd)


def sweep_abandoned(base: str | os.PathLike, match) -> list[Path]:
    """Remove the folders in `base` whose name `match(name)` accepts and whose maker is gone
    (owner_gone); returns those removed. Folders without an OWNER file, and those still held, stay."""
    import shutil

    gone = []
    try:
        names = sorted(p for p in Path(base).iterdir() if match(p.name))
    except OSError:
        return gone
    for p in names:
        if p.is_dir() and not p.is_symlink() and owner_gone(p):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone
