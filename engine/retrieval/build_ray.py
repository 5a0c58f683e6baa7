"""Embed a gallery on Ray Data: the single-process build (engine.retrieval.gallery) with its
chunks spread over Ray actors, one per worker, each holding the CLIP towers loaded once.

    scripts/build.sh --ray [--workers N] --corpus DIR --index-dir INDEX [...]   (evaluator.cir.build)

The driver holds the index's lock, checks which chunks are finished (gallery's ChunkStore),
and builds a Ray Dataset with one row per unfinished chunk (its number and item range: the
object store holds chunk numbers and records, never pixels). Each actor embeds its chunk's
images (engine.retrieval.embed.embed_images) and writes the chunk file with ChunkStore.save,
the single build's own format, returning the chunk's record. The driver then commits with
gallery's commit (extras included). Resumable as the single build is: a stopped build
restarts at its unfinished chunks. Without RAY_ADDRESS a local Ray starts on this machine;
with it, the build joins that cluster (the index folder must then be on a shared disk).
Ray is imported in this module only.

Every failure is one line of ours (RayBuildError, its exit status with it): Ray or Ray Data not
importable, a malformed RAY_ADDRESS or one where nothing answers within CONNECT_TIMEOUT_S, too little
room in TMPDIR for a local Ray, an actor's own error (carried back as a row, never as Ray's
ActorDiedError), a worker that died (the cause named: a full disk, memory, else Ray's first line).
A dead actor is not restarted nor its chunk retried (Ray Data's default: forever); the build ends.
A local Ray lives in its own folder TMPDIR/ray-<random>; on every exit (success, failure,
SIGTERM, SIGHUP, SIGINT) its processes are stopped and the folder removed (RaySession).
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

from engine.retrieval import gallery
from engine.retrieval.presets import RETRIEVAL

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
        if self.temp_dir is not None:
            kill_all([*pids, *processes_naming(self.temp_dir)])
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


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


def load_towers(model_dir, model_name, batch_size: int, device, precision):
    """CLIP towers as the single build loads them: (towers, info)."""
    from engine.clip.load import load_clip
    from engine.clip.towers import ClipTowers

    model, spec, info = load_clip(model_dir, model_name, batch_size)
    return ClipTowers(model, spec, device, precision), info


class ChunkEmbedder:
    """A Ray actor: towers and decoder loaded once; each row of a batch is one chunk to embed
    and save. Returns each chunk's record (chunk, sha256, decoder, rows), or its error: an error
    of ours travels back as a row's `error` (one line), so the driver says it as it was raised
    (a constructor that raised would reach the driver as Ray's ActorDiedError, and be restarted)."""

    def __init__(self, tower_args: tuple, key: dict, corpus: str, index_dir: str, decoder: str,
                 batch_size: int, readers: int, confine: bool, towers_record: dict | None = None):
        self.error = None
        try:
            self._load(tower_args, key, corpus, index_dir, decoder, batch_size, readers, confine, towers_record)
        except Exception as e:          # noqa: BLE001 -- said by the driver, in one line
            self.error = _error_line(e)

    def _load(self, tower_args, key, corpus, index_dir, decoder, batch_size, readers, confine, towers_record):
        from engine import settings as engine_settings
        from engine.clip import tune
        from engine.decoders import make_decoder
        from engine.retrieval.index import ChunkStore
        from engine.retrieval.jsonl import record_reader

        recs = read_own_records(Path(corpus), key)
        towers, _ = load_towers(*tower_args)
        # the towers the driver measured and chose (engine.clip.tune), loaded without compiling
        self.towers = tune.load_recorded(towers, Path(index_dir), towers_record, _log)
        self.dec = make_decoder(decoder, self.towers.spec.image, batch_size,
                                isolate=engine_settings.decoder_isolate())
        self.store = ChunkStore(Path(index_dir), key)
        self.paths = [r.path for r in recs]
        self.ids, self.lines = [r.image_id for r in recs], [r.line for r in recs]
        self.read = record_reader(Path(corpus), self.paths, confine)
        self.batch_size, self.readers = batch_size, readers

    def __call__(self, batch: dict) -> dict:
        import json

        out = {"chunk": [], "record": [], "error": []}
        for c, lo, hi in zip(batch["chunk"], batch["lo"], batch["hi"]):
            rec, err = {}, self.error
            if err is None:
                try:
                    rec = self.embed_chunk(int(c), int(lo), int(hi))
                except Exception as e:      # noqa: BLE001 -- said by the driver, in one line
                    err = _error_line(e)
            out["chunk"].append(int(c))
            out["record"].append(json.dumps(rec))
            out["error"].append(err or "")
        return out

    def embed_chunk(self, chunk: int, lo: int, hi: int) -> dict:
        import numpy as np

        from engine.retrieval.embed import embed_images

        rows, emb, failed, decoders = [], [], [], set()
        for b in embed_images(self.read, range(lo, hi), self.dec, self.towers.encode_images,
                              self.batch_size, self.readers):
            decoders.update(b.decoders)
            k = 0
            for j, item in enumerate(b.items):
                if b.ok[j]:
                    rows.append(item)
                    emb.append(b.emb[k])
                    k += 1
                else:
                    failed.append({"image_id": self.ids[item], "path": self.paths[item],
                                   "line": self.lines[item], "reason": b.failed[item]})
        dim = self.towers.spec.embed_dim
        e = np.stack(emb) if emb else np.zeros((0, dim), np.float16)
        self.store.save(chunk, np.asarray(rows, np.int64), e, failed, "+".join(sorted(decoders)))
        rec = gallery_record(self.store, chunk)
        return {**rec, "chunk": chunk, "failed": len(failed)}


def _error_line(e: BaseException) -> str:
    """An actor's error as the driver says it: its message on one line (an OSError names its file)."""
    from engine.cli import one_line

    return one_line(e) if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {one_line(e)}"


def read_own_records(corpus: Path, key: dict) -> list:
    """The actor's own copy of the records (the object store carries chunk numbers only),
    checked against the build key: ValueError when records.jsonl changed since the driver read it."""
    import hashlib

    from engine.retrieval.jsonl import read_input, read_records

    path = corpus / "records.jsonl"
    sha = hashlib.sha256(read_input(path)).hexdigest()
    recs = read_records(path, lambda msg: None)      # the driver has said its warnings once
    if sha != key["records_sha256"] or len(recs) != key["records"]:
        raise ValueError(f"{path} changed while the build ran (sha256 {sha[:12]}, {len(recs)} records); "
                         "run the build again")
    return recs


def gallery_record(store, chunk: int) -> dict:
    import json

    return json.loads(store.record_path(chunk).read_text())


class _RayRun(gallery._Run):
    """gallery's build with `_embed` spread over Ray actors (everything else is the single build's)."""

    def __init__(self, *args, workers: int, tower_args: tuple, prog: str):
        super().__init__(*args)
        self.workers, self.tower_args, self.prog = workers, tower_args, prog

    def _embed(self, chunks: list[int]) -> bool:
        todo = chunks[:self.stop_after] if self.stop_after else chunks
        gpu = self.towers.device.type == "cuda"
        session = RaySession(self.prog, "finished chunks are kept; the same command resumes the build")
        with session:                     # Ray stopped and its folder removed on every way out
            ray = start_ray(session, min(self.workers, len(todo), local_capacity(gpu)))
            session.trap_signals()
            workers, line = capped_workers(self.workers, len(todo), session.capacity(gpu), "GPU" if gpu else "CPU")
            if line:
                _log(line)
            failure = self._run_chunks(ray, session, todo, workers, gpu)
            if failure:   # raised here, not in _run_chunks: no frame of ours holding Ray's objects outlives Ray
                raise RayBuildError(failure, 1)
        if self.stop_after and self.saved >= self.stop_after and len(todo) < len(chunks):
            _log(f"stopping after {self.saved} chunks, as asked (resumable)")
            return False
        return True

    def _run_chunks(self, ray, session, todo: list[int], workers: int, gpu: bool) -> str | None:
        """Embed `todo` on `workers` actors, one chunk per call; the line saying why it stopped on
        an actor's error or a worker's death, else None. (Returned, not raised: a traceback would keep
        this frame, its dataset and object refs alive past ray.shutdown, and a ref freed then makes
        Ray end the process.)"""
        import json

        n, size = len(self.records), self.chunk_size
        rows = [{"chunk": c, "lo": c * size, "hi": min((c + 1) * size, n)} for c in todo]
        with warnings.catch_warnings():   # Ray 2.60 deprecates max_restarts as arguments, with no other way
            warnings.filterwarnings("ignore", message=".*ray_remote_args.* is deprecated")
            ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
                ChunkEmbedder, batch_size=1, compute=ray.data.ActorPoolStrategy(size=workers),
                **bounded_retries(), **({"num_gpus": 1} if gpu else {"num_cpus": 1}),
                fn_constructor_kwargs=dict(
                    tower_args=self.tower_args, key=self.key, corpus=str(self.corpus),
                    index_dir=str(self.index_dir), decoder=self.dec.name, batch_size=self.batch_size,
                    readers=self.readers, confine=self.confine, towers_record=self.towers_record))
        t0 = time.perf_counter()
        images = 0
        rows_done = iter(ds.iter_rows())
        try:
            for i, row in enumerate(rows_done, 1):
                if row["error"]:
                    return f"a Ray actor failed: {row['error']}"
                rec = json.loads(row["record"])
                self.store.decoders[int(row["chunk"])] = rec["decoder"]
                self.embedded += rec["rows"]
                images += rec["rows"] + rec["failed"]
                self.saved += 1
                dt = time.perf_counter() - t0
                _log(f"chunk {int(row['chunk']) + 1}/{self.n_chunks} done ({i}/{len(todo)} this run, "
                     f"{images / dt if dt > 0 else 0.0:.1f} images/s)")
        except ray.exceptions.RayError as e:
            return session.death_line(e, self.index_dir)
        finally:
            self.t_embed += time.perf_counter() - t0
            close = getattr(rows_done, "close", None)
            if close is not None:         # Ray Data's executor stops before Ray does (no thread left calling it)
                try:
                    close()
                except Exception:         # noqa: BLE001 -- Ray's shutdown follows and ends what is left
                    pass
        return None


def build(records, records_sha: str, towers, info: dict, method: dict, *, tower_args: tuple,
          workers: int = RETRIEVAL.ray_workers, prog: str = "cir_build_ray", **kwargs) -> bool:
    """gallery.build on Ray: the same arguments (`kwargs`), plus `tower_args` (load_towers' arguments,
    for the actors) and `workers` (actors: one GPU each on CUDA, else one CPU each; capped at the
    units usable and the unfinished chunks, said in one line). The towers are chosen as the single
    build chooses them (gallery.set_towers_mode), once, by the driver; each actor loads the recorded
    choice. RayBuildError (one line, its exit status) when Ray cannot serve; a signal during the Ray
    phase stops Ray, removes its folder, says `PROG: interrupted (SIG...)` and exits 128 + signal."""
    import functools

    run = functools.partial(_RayRun, workers=workers, tower_args=tower_args, prog=prog)
    return gallery.build(records, records_sha, towers, info, method, make_run=run, **kwargs)
