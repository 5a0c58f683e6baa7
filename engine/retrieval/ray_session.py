"""Ray's lifetime for the gallery build (engine.retrieval.build_ray): checks before it starts,
a session of its own, and nothing left behind.

`preflight()` runs before the CLIP loads: Ray and Ray Data import, RAY_ADDRESS is well formed and
answers within CONNECT_TIMEOUT_S, and a local Ray has room and a short enough path in TMPDIR.
`RaySession` holds this build's Ray: joined (RAY_ADDRESS) or started here in TMPDIR/ray-<random>;
on leaving, and on SIGTERM, SIGHUP or SIGINT, it shuts Ray down, kills the processes that name its
folder and removes the folder. `capped_workers` bounds the actors by the units usable and the
unfinished chunks; `bounded_retries` turns off Ray Data's endless restarts. Every failure is a
RayBuildError: one line of ours and its exit status.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from engine.presets.retrieval import RETRIEVAL

ACTOR_RESTARTS = 0       # a dead actor ends the build (its finished chunks kept): Ray Data's default is forever
CONNECT_TIMEOUT_S = 10   # RAY_ADDRESS must accept a connection within this many seconds
SESSION_MB = 512         # a local Ray's session folder (logs, sockets, runtime files), beside spilled objects
RAY_DISK_LIMIT = 0.95    # Ray refuses to create or spill objects on a disk fuller than this (its default)
TEMP_PREFIX = "ray-"     # TMPDIR/ray-<random>: this build's local Ray (short: Ray's socket paths are bounded)
SOCKET_PATH_MAX = 107    # bytes of a Unix socket's path (Linux); Ray's sockets live in its session folder
# what a local Ray adds to TMPDIR in its longest socket path: /ray-<8>/session_<date_time_us>_<pid>/sockets/plasma_store
SOCKET_SUFFIX = len(f"/{TEMP_PREFIX}xxxxxxxx/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store")


def _log(msg: str) -> None:
    print(f"[cir_build_ray] {msg}", file=sys.stderr, flush=True)


class RayBuildError(Exception):
    """Ray cannot serve this build: one line for the user; `status`: 2 for a setting or the machine,
    found before any work, 1 for a failure while building."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def import_ray():
    """Ray with Ray Data, or RayBuildError naming the install line (Ray missing, or one of Ray Data's
    own imports, pandas or pyarrow, failing)."""
    import importlib.util

    hint = "pip install -e '.[scale]' (pins: requirements/scale.txt)"
    if importlib.util.find_spec("ray") is None:
        raise RayBuildError(f"--ray needs Ray Data, which is not installed: {hint}", 2)
    try:
        import ray
        import ray.data  # noqa: F401
    except Exception as e:          # noqa: BLE001 -- ImportError, or a broken native wheel
        from engine.cli import one_line

        raise RayBuildError(f"--ray needs Ray Data, which cannot be imported here ({one_line(e)}): {hint}",
                            2) from None
    return ray


def ray_address() -> tuple[str, tuple[str, int] | None] | None:
    """RAY_ADDRESS as (the address, (host, port) to reach, or None for `auto`); None when unset or
    `local` (a local Ray). RayBuildError (status 2) when it is none of HOST:PORT, ray://HOST:PORT,
    auto, local."""
    import re

    from engine import settings as engine_settings

    addr = (engine_settings.ray_address() or "").strip()
    if addr in ("", "local"):
        return None
    if addr == "auto":
        return addr, None
    rest = addr.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    name = re.fullmatch(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", host)
    if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise RayBuildError(f"RAY_ADDRESS {addr!r} is not HOST:PORT, ray://HOST:PORT, auto or local", 2)
    return addr, (host.strip("[]"), int(port))


def probe(addr: str, where: tuple[str, int], timeout: float = CONNECT_TIMEOUT_S) -> None:
    """RayBuildError when nothing accepts a connection at `where` within `timeout` s (Ray itself
    would retry for a minute, printing its GCS warnings)."""
    import socket

    try:
        socket.create_connection(where, timeout=timeout).close()
    except OSError as e:
        why = e.strerror or str(e) or type(e).__name__
        raise RayBuildError(f"RAY_ADDRESS {addr}: no Ray cluster answered within {timeout:g} s ({why})", 1) from None


def disk_problem(folder: Path, need_mb: int) -> str | None:
    """Why `folder`'s disk cannot hold `need_mb` MiB more, as Ray counts it (free space, and Ray's
    own limit on how full a disk it writes to), or None."""
    import shutil

    try:
        du = shutil.disk_usage(folder)
    except OSError:
        return None
    free_mb = du.free // 2**20
    if free_mb < need_mb or du.used + need_mb * 2**20 > RAY_DISK_LIMIT * du.total:
        return (f"{folder} has {free_mb} MiB free of {du.total // 2**20} MiB; a local Ray needs {need_mb} MiB "
                f"there (its session folder and the objects it spills) and refuses a disk over "
                f"{RAY_DISK_LIMIT:.0%} full")
    return None


def preflight(object_store_mb: int = RETRIEVAL.ray_object_store_mb) -> None:
    """What a --ray build needs, checked before anything loads: Ray Data importable, RAY_ADDRESS well
    formed and answering, or (a local Ray) room for it in TMPDIR and a TMPDIR path short enough for its
    sockets. RayBuildError (one line) if not."""
    from engine import settings as engine_settings

    import_ray()
    addr = ray_address()
    if addr is not None:
        if addr[1] is not None:
            probe(*addr)
        return
    tmp = engine_settings.tmpdir()
    room = SOCKET_PATH_MAX - SOCKET_SUFFIX
    if len(os.fsencode(tmp)) > room:
        raise RayBuildError(f"TMPDIR {tmp} is too long a path for a local Ray ({len(os.fsencode(tmp))} bytes; at "
                            f"most {room}: its Unix sockets go under it, and their paths are bounded): set TMPDIR "
                            "to a shorter folder", 2)
    problem = disk_problem(tmp, SESSION_MB + object_store_mb)
    if problem:
        raise RayBuildError(f"TMPDIR {problem}: set TMPDIR to a larger disk", 2)


class RaySession:
    """This build's Ray, held in a `with` block: joined (RAY_ADDRESS), or started here in its own
    folder TMPDIR/ray-<random>. On leaving (any exception included) Ray is shut down, the processes
    whose command line names that folder are killed, and the folder removed; SIGTERM, SIGHUP and
    SIGINT do the same, then say `PROG: interrupted (SIG...): KEPT` and exit 128 + signal."""

    SIGNALS = ("SIGTERM", "SIGHUP", "SIGINT")

    def __init__(self, prog: str, kept: str):
        self.prog, self.kept = prog, kept
        self.ray = None
        self.temp_dir: Path | None = None    # the local Ray's folder (None: joined, or not started)
        self.started = False                 # ray.init was called here (shut down on leaving)
        self.guardian = None                 # the process that cleans up if this one is killed outright
        self._previous: dict = {}

    def __enter__(self) -> RaySession:
        self.trap_signals()
        return self

    def trap_signals(self) -> None:
        """Our handlers for SIGTERM, SIGHUP, SIGINT (again after ray.init: Ray's core worker puts its
        own in, which dumps a native stack and aborts with exit 134)."""
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            previous = signal.signal(sig, self._on_signal)
            self._previous.setdefault(sig, previous)

    def __exit__(self, *exc) -> None:
        import signal

        try:
            self.close()
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, _frame) -> None:
        import signal

        self.close(graceful=False)   # ray.shutdown from inside an interrupted Ray call may abort
        try:
            sys.stderr.write(f"{self.prog}: interrupted ({signal.Signals(sig).name}): {self.kept}\n")
            sys.stderr.flush()
        finally:
            os._exit(128 + sig)

    def capacity(self, gpu: bool) -> int:
        """Units (GPUs on CUDA, else CPUs) the Ray this build uses offers."""
        return int(self.ray.cluster_resources().get("GPU" if gpu else "CPU", 0))

    def death_line(self, e: BaseException, index_dir: Path) -> str:
        """A worker died or a task failed for good (`e`, a Ray error): the cause in one line, a full
        disk named by its path first, then memory, else Ray's own first line."""
        from engine import settings as engine_settings

        for folder, need in ((self.temp_dir or engine_settings.tmpdir(), SESSION_MB), (index_dir, 64)):
            problem = disk_problem(folder, need)
            if problem:
                return f"a Ray worker died for want of disk: {problem}"
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        if isinstance(e, getattr(self.ray.exceptions, "OutOfMemoryError", ())) or "memory" in first.lower():
            return f"a Ray worker died for want of memory ({type(e).__name__}): {first[:300]}"
        return f"a Ray worker died ({type(e).__name__}): {first[:300]}"

    def close(self, graceful: bool = True) -> None:
        """Stop what this build started (never a cluster it joined) and remove its folder."""
        import shutil

        # listed before the shutdown: once the raylet is gone, its agents are nobody's descendants
        pids = processes_naming(self.temp_dir) if self.temp_dir is not None else []
        if self.started and graceful:
            import gc

            gc.collect()      # object refs freed after the shutdown would make Ray end the process
            try:
                self.ray.shutdown()
            except Exception as e:        # noqa: BLE001 -- what is left is killed below
                _log(f"Ray's shutdown failed ({type(e).__name__}); stopping its processes")
        self.started = False
        guardian = self.guardian.pid if self.guardian is not None else None
        if self.temp_dir is not None:
            kill_all([p for p in (*pids, *processes_naming(self.temp_dir)) if p != guardian])
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None
        if self.guardian is not None:     # its work is done here: nothing of this build is left
            self.guardian.kill()
            self.guardian.wait()
            self.guardian = None


# The guardian: started beside a local Ray, it notes every second the processes of that Ray (by pid
# and start time: the agents leave the raylet's tree once it exits, and a pid may be reused); when
# the build dies outright (kill -9: no handler of ours runs) the kernel sends it SIGTERM
# (engine.children, PR_SET_PDEATHSIG), and it kills those still running and removes the folder.
GUARDIAN = """
import os, shutil, signal, sys, time
from pathlib import Path
from engine.retrieval.ray_session import kill_all, processes_naming, started_at
folder, me, seen = Path(sys.argv[1]), os.getpid(), {}
def note():
    for p in processes_naming(folder):
        if p != me:
            seen.setdefault(p, started_at(p))
def end(*_):
    note()
    kill_all([p for p, t in seen.items() if t is not None and started_at(p) == t])
    shutil.rmtree(folder, ignore_errors=True)
    os._exit(0)
signal.signal(signal.SIGTERM, end)
signal.signal(signal.SIGINT, signal.SIG_IGN)
while True:
    note()
    time.sleep(1.0)
"""


def started_at(pid: int) -> int | None:
    """`pid`'s start time (clock ticks since boot, /proc/PID/stat), None when it is gone: with the pid,
    it names one process, never another that reused the number."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def start_guardian(folder: Path):
    """The guardian process of `folder` (GUARDIAN): a child that dies with this process, cleaning up."""
    from engine import children
    from engine.io import project_root

    # run from the folder holding the engine package: `python -c` finds it there, whatever PYTHONPATH says
    return children.popen([sys.executable, "-c", GUARDIAN, str(Path(folder).resolve())], cwd=project_root(),
                          stdin=subprocess.DEVNULL)


def processes_naming(folder: Path) -> list[int]:
    """Every process whose command line names `folder` (a local Ray's GCS, raylet, monitors) and all
    their descendants (workers and agents, which rename their command lines). Linux (/proc);
    elsewhere none are found."""
    needle = str(folder).encode()
    children: dict[int, list[int]] = {}
    roots = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            pid = int(d.name)
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(") ", 1)[1].split()[1])     # after "pid (comm) state"
            if pid != os.getpid() and needle in (d / "cmdline").read_bytes():
                roots.append(pid)
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(pid)
    pids, todo = [], list(roots)
    while todo:                     # the roots and their descendants
        pid = todo.pop()
        if pid not in pids:
            pids.append(pid)
            todo.extend(children.get(pid, []))
    return pids


def kill_all(pids: list[int], wait_s: float = 5.0) -> None:
    """SIGKILL `pids`, then wait (at most `wait_s`) for them to go."""
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    for pid in pids:
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.02)


def _alive(pid: int) -> bool:
    """`pid` runs (a zombie child is reaped and counts as gone)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] not in ("Z", "X")
    except OSError:
        return False


def start_ray(session: RaySession, local_cpus: int, object_store_mb: int = RETRIEVAL.ray_object_store_mb):
    """Join RAY_ADDRESS's cluster, or start a local Ray of `local_cpus` CPUs in the session's own
    folder under TMPDIR; RayBuildError (one line) when Ray cannot start or join."""
    import logging
    import tempfile

    from engine import settings as engine_settings
    from engine.cli import one_line

    ray = import_ray()
    session.ray = ray
    for name in ("ray", "ray.data"):     # Ray Data's INFO lines (its plan, its log folder) stay in its logs
        logging.getLogger(name).setLevel(logging.WARNING)
    ray.data.DataContext.get_current().enable_progress_bars = False   # ours: chunks done, images/s
    if ray.is_initialized():             # the caller's own Ray (in-process use): left running
        return ray
    addr = ray_address()
    try:
        if addr is not None:
            if addr[1] is not None:
                probe(*addr)
            session.started = True
            ray.init(address=addr[0], log_to_driver=False, logging_level=logging.WARNING)
        else:
            session.temp_dir = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=engine_settings.tmpdir()))
            session.guardian = start_guardian(session.temp_dir)
            session.started = True
            ray.init(address="local", num_cpus=max(local_cpus, 1), include_dashboard=False, log_to_driver=False,
                     object_store_memory=object_store_mb * 1024 * 1024, logging_level=logging.WARNING,
                     _temp_dir=str(session.temp_dir))
    except (ConnectionError, RuntimeError, ValueError, TimeoutError, OSError) as e:
        where = f"join the Ray cluster at {addr[0]}" if addr else f"start a local Ray in {session.temp_dir}"
        raise RayBuildError(f"cannot {where}: {one_line(e)}", 1) from None
    return ray


def bounded_retries() -> dict:
    """The actors' restarts and task retries (Ray Data restarts a dead actor and retries its task
    forever by default: a worker killed for want of disk or memory would be restarted until an
    outside timeout)."""
    return {"max_restarts": ACTOR_RESTARTS, "max_task_retries": ACTOR_RESTARTS}


def local_capacity(gpu: bool) -> int:
    """Actors a local Ray may hold here: the GPUs on CUDA, else the CPUs this process may run on."""
    if gpu:
        import torch

        return torch.cuda.device_count()
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:        # not Linux
        return os.cpu_count() or 1


def capped_workers(asked: int, unfinished: int, capacity: int, unit: str) -> tuple[int, str | None]:
    """(actors to start, the line saying why fewer than asked, or None): at most one per unit this
    build may use (CPU, or GPU on CUDA) and one per unfinished chunk; more would only wait for
    room, each holding its towers in memory."""
    n = min(asked, unfinished, capacity)
    if n < 1:
        raise RayBuildError(f"the Ray cluster offers no {unit} for the actors", 1)
    if n == asked:
        return n, None
    return n, (f"--workers {asked}: starting {n} actors ({capacity} {unit}s usable, "
               f"{unfinished} unfinished chunks)")
