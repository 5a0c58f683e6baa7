"""engine.classify.pipeline.classify with fake decoder and runtime: order, padding, failures, errors, no hangs."""
from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from engine.classify.pipeline import Result, classify

BSZ = 16
S = 2  # fake image side: the pipeline never looks at the pixels


class IndexDecoder:
    """decode(blobs) -> [n, S, S, 3] int32 whose pixel [0, 0, 0] is the item index encoded in the blob."""

    name = "fake"

    def __init__(self, fail_on: set[bytes] = frozenset(), raise_on_call: int | None = None):
        self.fail_on, self.raise_on_call = fail_on, raise_on_call
        self.calls = 0
        self.lock = threading.Lock()

    def decode(self, blobs):
        with self.lock:
            self.calls += 1
            call = self.calls
        if self.raise_on_call is not None and call >= self.raise_on_call:
            raise RuntimeError(f"decoder exploded on batch {call - 1}")
        out = np.zeros((len(blobs), S, S, 3), np.int32)
        failed = {}
        for j, blob in enumerate(blobs):
            if blob is None:
                failed[j] = "not read"
            elif blob in self.fail_on:
                failed[j] = "cannot decode"
            else:
                out[j, 0, 0, 0] = int(blob.split(b":")[1])
        return out, failed


class EchoRuntime:
    """run(arr) -> arr[:, 0, 0, 0]; asserts the static batch shape on every call."""

    name = "fake"

    def __init__(self, batch_size: int = BSZ, raise_on_call: int | None = None):
        self.batch_size, self.raise_on_call = batch_size, raise_on_call
        self.shapes: list[tuple] = []

    def run(self, arr):
        assert arr.shape[0] == self.batch_size, f"runtime got {arr.shape[0]} rows, not {self.batch_size}"
        self.shapes.append(tuple(arr.shape))
        if self.raise_on_call is not None and len(self.shapes) >= self.raise_on_call:
            raise RuntimeError("runtime exploded")
        return arr[:, 0, 0, 0].astype(np.int32)


def reader(n: int, errors: set[int] = frozenset(), jitter: float = 0.0, seed: int = 0):
    rnd = random.Random(seed)
    delays = [rnd.uniform(0, jitter) for _ in range(n)]

    def read(i: int) -> bytes:
        if delays[i]:
            time.sleep(delays[i])  # readers finish out of order
        if i in errors:
            raise OSError(f"cannot open item {i}")
        return f"item:{i}".encode()

    return read


def run_with_timeout(fn, timeout: float = 30.0):
    """fn() in a thread; a hang fails the test instead of freezing the session."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below in the test thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"classify did not return within {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _pipeline_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "decode" or t.name.startswith("reader")]


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
def test_order_preserved_and_last_batch_padded(n, depth):
    rt = EchoRuntime()
    res = run_with_timeout(lambda: classify(reader(n, jitter=0.002, seed=n), n, IndexDecoder(), rt, readers=8,
                                            depth=depth))
    assert isinstance(res, Result)
    assert res.top1.dtype == np.int32 and res.top1.tolist() == list(range(n))
    assert res.failed == {}
    nb = -(-n // BSZ)
    assert rt.shapes == [(BSZ, S, S, 3)] * nb  # every call full size, the last one padded
    assert res.first_batch_at is not None
    assert set(res.stages) == {"read", "decode", "inference"} and all(v >= 0 for v in res.stages.values())


def test_padding_rows_are_zero():
    seen = []

    class Spy(EchoRuntime):
        def run(self, arr):
            seen.append(arr.copy())
            return super().run(arr)

    res = run_with_timeout(lambda: classify(reader(17), 17, IndexDecoder(), Spy()))
    assert res.top1.tolist() == list(range(17))
    last = seen[-1]
    assert last[0, 0, 0, 0] == 16 and not last[1:].any()


@pytest.mark.parametrize("depth", [0, 2])
def test_zero_items(depth):
    rt = EchoRuntime()
    res = run_with_timeout(lambda: classify(reader(0), 0, IndexDecoder(), rt, depth=depth))
    assert res.top1.shape == (0,) and rt.shapes == [] and res.timeline == []


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_no_threads_left_after_success(depth):
    before = set(_pipeline_threads())
    res = run_with_timeout(lambda: classify(reader(100), 100, IndexDecoder(), EchoRuntime(), depth=depth))
    assert res.top1.tolist() == list(range(100))
    assert [t for t in _pipeline_threads() if t not in before and t.is_alive()] == []


def test_read_errors_land_in_failed_with_the_reason():
    n, errors = 40, {0, 15, 16, 33, 39}
    res = run_with_timeout(lambda: classify(reader(n, errors, jitter=0.001), n, IndexDecoder(), EchoRuntime()))
    assert set(res.failed) == errors
    for i in errors:
        assert res.failed[i] == f"OSError: cannot open item {i}"
        assert res.top1[i] == 0  # a failed item keeps the zero image's prediction
    ok = [i for i in range(n) if i not in errors]
    assert res.top1[ok].tolist() == ok


def test_decoder_failures_get_global_indices():
    n = 50
    bad = {f"item:{i}".encode() for i in (3, 20, 48)}
    res = run_with_timeout(lambda: classify(reader(n, {21}), n, IndexDecoder(fail_on=bad), EchoRuntime()))
    assert res.failed == {3: "cannot decode", 20: "cannot decode", 48: "cannot decode",
                          21: "OSError: cannot open item 21"}


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("n, raise_on_call", [(100, 1), (100, 2), (100, 7), (17, 2)])
def test_decoder_exception_propagates_and_the_worker_ends(n, raise_on_call, depth):
    before = set(_pipeline_threads())
    rt = EchoRuntime()
    with pytest.raises(RuntimeError, match="decoder exploded") as excinfo:
        run_with_timeout(lambda: classify(reader(n), n, IndexDecoder(raise_on_call=raise_on_call), rt, depth=depth))
    assert len(rt.shapes) == raise_on_call - 1  # batches before the failure inferred, none after
    # checked while the caller still holds the error (and so classify's frame)
    leftover = [t for t in _pipeline_threads() if t not in before and t.is_alive()]
    assert leftover == [] and excinfo.value is not None, leftover


@pytest.mark.parametrize("depth", [0, 1])
@pytest.mark.parametrize("raise_on_call", [1, 3])
def test_runtime_exception_propagates_and_the_worker_ends(raise_on_call, depth):
    before = set(_pipeline_threads())
    with pytest.raises(RuntimeError, match="runtime exploded") as excinfo:
        run_with_timeout(lambda: classify(reader(200), 200, IndexDecoder(), EchoRuntime(raise_on_call=raise_on_call),
                                          depth=depth))
    leftover = [t for t in _pipeline_threads() if t not in before and t.is_alive()]
    assert leftover == [] and excinfo.value is not None, leftover


def test_runtime_exception_propagates():
    """The error itself reaches the caller whatever happens to the threads (and nothing hangs)."""
    with pytest.raises(RuntimeError, match="runtime exploded"):
        run_with_timeout(lambda: classify(reader(200), 200, IndexDecoder(), EchoRuntime(raise_on_call=2), depth=1))


def test_progress_is_called_with_increasing_counts():
    counts: list[int] = []
    res = run_with_timeout(lambda: classify(reader(50), 50, IndexDecoder(), EchoRuntime(), progress=counts.append))
    assert counts == [16, 32, 48, 50]
    assert res.top1.tolist() == list(range(50))


def test_timeline_has_decode_and_inference_per_batch():
    n = 70
    nb = -(-n // BSZ)
    res = run_with_timeout(lambda: classify(reader(n), n, IndexDecoder(), EchoRuntime()))
    for stage in ("decode", "inference"):
        entries = sorted((e for e in res.timeline if e["stage"] == stage), key=lambda e: e["batch"])
        assert [e["batch"] for e in entries] == list(range(nb)), stage
        assert all(e["start"] <= e["end"] for e in entries)
    dec = {e["batch"]: e for e in res.timeline if e["stage"] == "decode"}
    inf = {e["batch"]: e for e in res.timeline if e["stage"] == "inference"}
    for b in range(nb):
        assert dec[b]["end"] <= inf[b]["start"]  # a batch infers only after it is decoded
    assert res.first_batch_at == inf[0]["end"]
    assert len(res.timeline) == 2 * nb


def test_next_batch_decodes_while_the_current_one_infers():
    """Batch 1 must be decoded while batch 0 is still inside runtime.run (the overlap)."""
    decoded_1 = threading.Event()

    class SignalDecoder(IndexDecoder):
        def decode(self, blobs):
            out = super().decode(blobs)
            if self.calls == 2:
                decoded_1.set()
            return out

    class WaitRuntime(EchoRuntime):
        def run(self, arr):
            if not self.shapes:
                assert decoded_1.wait(10), "batch 1 was not decoded while batch 0 inferred"
            return super().run(arr)

    res = run_with_timeout(lambda: classify(reader(48), 48, SignalDecoder(), WaitRuntime()))
    assert res.top1.tolist() == list(range(48))


def test_injected_clock_is_used():
    ticks = iter(range(1, 10_000))
    lock = threading.Lock()

    def clock() -> float:
        with lock:
            return float(next(ticks))

    res = run_with_timeout(lambda: classify(reader(20), 20, IndexDecoder(), EchoRuntime(), clock=clock))
    assert all(float(e["start"]).is_integer() and e["end"] > e["start"] for e in res.timeline)


# ------------------------------------------------------------ reading files: regular files only
def test_read_regular_returns_the_bytes(tmp_path):
    from engine.io import read_regular

    p = tmp_path / "a.bin"
    data = bytes(range(256)) * 1000
    p.write_bytes(data)
    assert read_regular(p, len(data)) == data
    (tmp_path / "empty").write_bytes(b"")
    assert read_regular(tmp_path / "empty", 10) == b""


def test_read_regular_refuses_an_oversized_file_without_reading_it(tmp_path):
    from engine.io import read_regular

    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(3 << 30)                       # sparse 3 GiB: reading it would take seconds and memory
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"has 3221225472 bytes, above the limit of 1024 \(ENGINE_MAX_FILE_BYTES\)"):
        read_regular(big, 1024)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("kind", ["fifo", "directory", "socket", "device", "symlink"])
def test_read_regular_refuses_what_is_not_a_regular_file_without_blocking(tmp_path, kind):
    import os
    import socket

    from engine.io import read_regular

    p = tmp_path / "x"
    if kind == "fifo":
        os.mkfifo(p)                              # a blocking open would wait for a writer forever
    elif kind == "directory":
        p.mkdir()
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
    elif kind == "device":
        p = "/dev/zero"                           # endless: reading it whole would never end
    else:
        (tmp_path / "real").write_bytes(b"data")
        p.symlink_to(tmp_path / "real")           # a final symlink is not followed (resolve first)
    box: list = []

    def attempt():
        try:
            read_regular(p, 1 << 20)
        except (OSError, ValueError) as e:
            box.append(e)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), f"read_regular blocked on a {kind}"
    want = {"fifo": "a FIFO", "directory": "a directory", "socket": "", "device": "a character device",
            "symlink": ""}[kind]
    assert box and want in str(box[0])


def test_resolve_inside_refuses_escapes_and_returns_the_real_path(tmp_path):
    from engine.io import resolve_inside

    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f").write_bytes(b"x")
    (root / "out").symlink_to(tmp_path)
    assert resolve_inside(root, "sub/f") == str((root / "sub" / "f").resolve())
    for rel, what in [("/etc/passwd", "absolute"), ("../x", "escapes the corpus"), ("out/x", "escapes the corpus"),
                      ("a\x00b", "NUL")]:
        with pytest.raises(ValueError, match=what):
            resolve_inside(root, rel, "the corpus")


# ------------------------------------------------------------ the thread budget
def test_the_thread_budget_derives_every_pool_from_one_setting(monkeypatch):
    from engine import settings, threads

    monkeypatch.setenv("ENGINE_THREADS", "6")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)        # the kit's default: PASSIVE
    b = threads.budget("cpu")
    assert (b.total, b.readers, b.decoder, b.intra_op, b.inter_op) == (6, 6, 6, 6, 1)
    assert threads.budget("cuda").intra_op == 4
    assert threads.library_env(b) == {"OMP_NUM_THREADS": "6", "MKL_NUM_THREADS": "6", "OPENBLAS_NUM_THREADS": "1",
                                      "OMP_WAIT_POLICY": "PASSIVE"}
    assert b.peak() == 1 + 6 + 1 + 2 * 5 + 6 + 3 + 2 and b.peak(isolated_decoder=False) == b.peak() - 2
    monkeypatch.setenv("ENGINE_READERS", "3")
    assert threads.budget().readers == 3
    monkeypatch.setenv("ENGINE_THREADS", "40")
    monkeypatch.delenv("ENGINE_READERS")
    assert threads.budget().readers == 8 and threads.budget().decoder == 40
    monkeypatch.delenv("ENGINE_THREADS")
    assert settings.threads() == min(settings.usable_cpus(), settings.MAX_THREADS)
    assert settings.usable_cpus() == len(__import__("os").sched_getaffinity(0))
    monkeypatch.setenv("ENGINE_THREADS", "0")
    with pytest.raises(settings.SettingsError, match="ENGINE_THREADS"):
        threads.budget()


# ------------------------------------------------------------ best-effort diagnostics
def test_quiet_streams_swallow_write_failures_and_stay_transparent(tmp_path):
    import io
    import os
    import subprocess
    import sys

    from engine.stdio import QuietStream

    full = open("/dev/full", "w")
    q = QuietStream(full)
    assert q.write("lost") == 4
    q.flush()                                       # ENOSPC swallowed
    try:
        full.close()                                # closing flushes again: ENOSPC once more
    except OSError:
        pass
    assert q.write("closed") == 6 and not q.isatty()
    assert QuietStream(None).write("nothing") == 7  # a process started with fd 2 closed has no sys.stderr
    inner = io.TextIOWrapper(io.BytesIO(), encoding="latin-1")
    assert QuietStream(inner).encoding == "latin-1" and QuietStream(inner).buffer is inner.buffer
    # fds 0-2 closed at start: they are reopened on /dev/null, so a file opened later never becomes fd 2
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from engine.stdio import safe_std_streams; "
            "safe_std_streams(); fd = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT); print('x', file=sys.stderr); "
            "os.write(fd, str(fd).encode())")
    from conftest import REPO

    target = tmp_path / "fd.txt"
    r = subprocess.run(["sh", "-c", '"$@" <&- >&- 2>&-', "sh", sys.executable, "-c", code, str(REPO), str(target)])
    assert r.returncode == 0 and int(target.read_text()) > 2
    assert os.path.exists(target)
