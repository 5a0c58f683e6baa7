"""A CPU decoder in a child process: a native crash or a hang there costs one image, not the run.

DALI's CPU decoder can crash the process when a sample fails inside it (its thread pool
outlives the error), and a hostile JPEG (thousands of progressive scans) can keep any
decoder busy for minutes. So by default (`ENGINE_DECODER_ISOLATE=1`) the decoders a
module lists in `ISOLABLE` run here, and so does the PIL reference of the GPU decoders
(`reference_decoder`), each image under a deadline of its own:

    parent                                    child (python -c ... engine.decoders.isolate)
      request: n, mode, n lengths, n blobs ──pipe──►  decoder.decode(blobs, progress)
      progress: {"at": i} before image i   ◄─pipe──   (-1: the decoder's routed batch)
      reply:   {"failed": {...}}           ◄─pipe──   pixels -> shared memory (memfd), [n, S, S, 3] uint8

The parent waits at most ENGINE_DECODE_DEADLINE_S after each progress line (the routed
batch gets `deadline(n)`). When the child dies or overstays, it is killed; the image it
was on is unreadable (a prediction and a stderr line, never decoded again), and a fresh
child decodes the rest of the batch. A failure with no image to blame (inside the routed
batch) sends the batch once more in reference mode: the PIL reference in the child, one
image at a time, so the next failure names its image. After MAX_RESTARTS failures, or if
the decoder cannot start, the PIL reference runs in the child instead (still under the
deadline); only when no child process can run at all does the parent decode. The
child's stdout carries only the protocol (its fd 1 points at stderr), and it leaves by
itself when the parent is gone.
"""
from __future__ import annotations

import json
import mmap
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from engine.core.spec import Spec

MAX_RESTARTS = 5
NONE = 0xFFFFFFFF                    # length of a blob that was not read
NORMAL, REFERENCE = 0, 1             # request modes: the decoder, or the PIL reference one image at a time
HELLO_S = 120.0                      # a child's start (imports, pipeline build) may take this long
_ROOT = str(Path(__file__).resolve().parents[2])   # the folder holding the engine package
_CHILD = ("import sys; sys.path.insert(0, sys.argv[1]); "
          "from engine.decoders.isolate import child_main; child_main()")
_REFERENCE_MODULE = "engine.decoders.pil"


def deadline_s(n: int) -> float:
    """Seconds the decoder's routed batch of n images may take before the child counts as hung."""
    from engine import settings

    return settings.decode_deadline_s() + 1.0 * n


class ChildFailed(RuntimeError):
    """The child died, overstayed or answered an error; `at` is the image it was on (None: unknown)."""

    def __init__(self, why: str, at: int | None):
        super().__init__(why)
        self.at = at


class IsolatedDecoder:
    """The decoder `name` (from `module`) in a child process; the same `.decode` interface."""

    isolated = True

    def __init__(self, name: str, module: str, spec: Spec, batch_size: int, threads: int | None = None,
                 deadline=deadline_s, file_deadline: float | None = None):
        """`deadline(n)`: seconds the routed batch of n images may take; `file_deadline`: seconds one
        image may take (default ENGINE_DECODE_DEADLINE_S)."""
        from engine import settings
        from engine.decoders.pil import PilDecoder

        self.name, self.module, self.spec = name, module, spec
        self._pending = b""
        self.batch_size, self.threads = batch_size, threads
        self._slot = batch_size * spec.input_size * spec.input_size * 3     # bytes of one [B, S, S, 3] batch
        self._in_process = PilDecoder(spec, batch_size, threads)            # only when no child can run
        self._proc = None
        self._map = None
        self._ready = False
        self._closed = False
        self._lock = threading.Lock()          # close() may come from another thread than decode()
        self.deadline = deadline
        self.file_deadline = settings.decode_deadline_s() if file_deadline is None else file_deadline
        self.crashes = 0                       # child failures, all kinds
        self._unexplained = 0                  # ... with no image to blame: the decoder's own fault
        self._start()

    # ------------------------------------------------------------ child management
    def _start(self) -> None:
        """Start a child (not waited for: it builds its pipeline while the caller loads the model)."""
        fd = os.memfd_create("decoded-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self._slot)
            self._map = mmap.mmap(fd, self._slot)
            config = {"module": self.module, "name": self.name, "spec": self.spec.to_dict(),
                      "batch_size": self.batch_size, "threads": self.threads, "fd": fd, "bytes": self._slot,
                      "parent": os.getpid()}
            self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, _ROOT], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, pass_fds=(fd,), close_fds=True)
            self._pending = b""                 # bytes of the child's next protocol line
        finally:
            os.close(fd)   # the parent keeps its mapping; the child has its own descriptor
        self._proc.stdin.write((json.dumps(config) + "\n").encode())
        self._proc.stdin.flush()
        self._ready = False

    def _restart(self) -> bool:
        """A fresh child (the reference's after MAX_RESTARTS failures); False when none can start."""
        if self._unexplained > MAX_RESTARTS and self.module != _REFERENCE_MODULE:
            print(f"[engine] {self.name} (isolated): {self._unexplained} failures; the pil reference decodes "
                  "the rest, in its own process", file=sys.stderr)
            self.name, self.module, self.threads = "pil", _REFERENCE_MODULE, 1
        try:
            self._start()
            return True
        except OSError as e:
            print(f"[engine] {self.name} (isolated): cannot start a decoder process ({e}); "
                  "pil decodes the rest in this process", file=sys.stderr)
            self._stop()
            return False

    def _reply(self, timeout: float, at: int | None = None) -> dict:
        """The child's next JSON line; ChildFailed when it died or stayed silent past `timeout`.
        Read from the raw descriptor (a buffered reader could hold a line select cannot see)."""
        proc = self._proc
        if proc is None:
            raise ChildFailed("the decoder process was closed", at)
        fd = proc.stdout.fileno()
        end = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = end - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0.0))
            if not ready:
                raise ChildFailed(f"no answer within {timeout:g} s", at)
            data = os.read(fd, 1 << 16)
            if not data:
                rc = proc.wait()
                why = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
                raise ChildFailed(f"the decoder process died ({why})", at)
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def _stop(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is not None:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                for f in (proc.stdin, proc.stdout):
                    try:
                        f.close()
                    except OSError:
                        pass
            if self._map is not None:
                try:
                    self._map.close()
                except BufferError:    # a decode in another thread still reads it: freed with the object
                    pass
                self._map = None

    def close(self) -> None:
        """Stop the child now (also from another thread: a decode waiting on it returns at once)."""
        self._closed = True
        self._stop()

    def __del__(self):
        try:
            self._stop()
        except Exception:  # noqa: BLE001 - interpreter teardown: nothing left to report to
            pass

    # ------------------------------------------------------------ decoding
    def decode(self, blobs: list[bytes | None]):
        """(uint8 [n, S, S, 3], {index: reason}); an image the child cannot finish in time is unreadable."""
        n = len(blobs)
        if n > self.batch_size:  # the shared slot holds one batch: larger requests go in pieces
            parts = [self.decode(blobs[i:i + self.batch_size]) for i in range(0, n, self.batch_size)]
            failed = {i + j * self.batch_size: why for j, (_, f) in enumerate(parts) for i, why in f.items()}
            return np.concatenate([a for a, _ in parts]), failed
        blobs = list(blobs)
        failed: dict[int, str] = {}           # images given up on here (deadline, crash): sent as None
        mode, blind = NORMAL, 0
        while True:
            if self._closed:
                raise RuntimeError(f"decoder {self.name} is closed")
            if self._proc is None or (not self._ready and not self._hello()):
                arr, f = self._in_process.decode(blobs)
                return arr, {**f, **failed}
            try:
                arr, f = self._request(blobs, mode)
                return arr, {**f, **failed}
            except (OSError, ValueError, ChildFailed) as e:
                if self._closed:
                    raise RuntimeError(f"decoder {self.name} is closed") from None
                at = getattr(e, "at", None)
                self.crashes += 1
                self._unexplained += at is None or at < 0
                self._stop()
                if at is not None and at >= 0:
                    failed[at] = (f"not decoded within {self.file_deadline:g} s (ENGINE_DECODE_DEADLINE_S)"
                                  if "no answer" in str(e) else f"the decoder process failed on it ({e})")
                    blobs[at] = None
                    what = f"image {at} of this batch is unreadable"
                elif mode == NORMAL:
                    mode, what = REFERENCE, "redoing this batch with pil, one image at a time"
                else:
                    blind += 1
                    if blind >= 2:            # twice with no image to blame: give the batch up
                        for k, b in enumerate(blobs):
                            if b is not None:
                                failed[k] = f"the decoder process failed twice on this batch ({e})"
                        s = self.spec.input_size
                        return np.zeros((n, s, s, 3), np.uint8), failed
                    what = "redoing the batch"
                print(f"[engine] {self.name} (isolated): {e}; {what}; starting a fresh decoder process",
                      file=sys.stderr)
                if not self._restart():
                    continue

    def _request(self, blobs: list[bytes | None], mode: int):
        """One request to the child; ChildFailed naming the image it was on when it failed."""
        n = len(blobs)
        lengths = [NONE if b is None else len(b) for b in blobs]
        self._proc.stdin.write(struct.pack(f"<{n + 2}I", n, mode, *lengths))
        for b in blobs:
            if b:
                self._proc.stdin.write(b)
        self._proc.stdin.flush()
        at = None
        while True:
            timeout = self.deadline(n) if at is None or at < 0 else self.file_deadline
            reply = self._reply(timeout, at)
            if "at" in reply:
                at = int(reply["at"])
                continue
            if "error" in reply:
                raise ChildFailed(reply["error"], at)
            break
        s = self.spec.input_size
        arr = np.frombuffer(self._map, np.uint8, count=n * s * s * 3).reshape(n, s, s, 3).copy()
        return arr, {int(k): v for k, v in reply["failed"].items()}

    def _hello(self) -> bool:
        """Wait for the child's pipeline; a decoder that cannot start gives way to the reference in a child."""
        try:
            hello = self._reply(HELLO_S)
            if "error" in hello:
                raise RuntimeError(hello["error"])
        except (OSError, ValueError, RuntimeError) as e:
            print(f"[engine] decoder {self.name} unavailable in its process ({e}); using pil", file=sys.stderr)
            self._stop()
            if self.module == _REFERENCE_MODULE:
                return False
            self.name, self.module, self.threads = "pil", _REFERENCE_MODULE, 1
            return self._restart() and self._hello()
        self._ready = True
        return True


def reference_decoder(spec: Spec, batch_size: int, threads: int | None = None, isolate: bool = True):
    """The PIL reference for the images a GPU decoder routes away from itself (CMYK, progressive
    beyond 256 scans, other formats): in a child process, each image under the decode deadline,
    when `isolate` (ENGINE_DECODER_ISOLATE), else in this process. `.decode(blobs)` either way."""
    from engine.decoders.pil import PilDecoder

    if isolate:
        try:
            return IsolatedDecoder("pil", _REFERENCE_MODULE, spec, batch_size, threads)
        except (OSError, AttributeError) as e:  # no memfd, no fork
            print(f"[engine] pil: no child process ({type(e).__name__}: {e}); decoding in this process",
                  file=sys.stderr)
    return PilDecoder(spec, batch_size, threads)


def _read_exact(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError
    return data


def _leave_with_parent(parent: int) -> None:
    """Exit as soon as the parent is gone (killed mid-batch, the child would decode on for minutes)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def child_main() -> None:
    """The child: build the decoder, then answer one request per batch until stdin closes."""
    import importlib
    import inspect

    from engine.stdio import safe_std_streams

    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C is the parent's to handle
    proto = os.fdopen(os.dup(1), "wb", buffering=0)   # the protocol keeps the real stdout
    os.dup2(2, 1)                                     # anything else printed goes to stderr
    safe_std_streams()                                # a broken stderr must not fail a batch
    inp = sys.stdin.buffer
    cfg = json.loads(inp.readline())
    _leave_with_parent(cfg.get("parent", os.getppid()))
    shared = mmap.mmap(cfg["fd"], cfg["bytes"])
    try:
        spec = Spec.from_dict(cfg["spec"])
        dec = importlib.import_module(cfg["module"]).create(cfg["name"], spec, cfg["batch_size"], cfg["threads"])
    except Exception as e:  # noqa: BLE001 - reported to the parent, which falls back
        proto.write((json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n").encode())
        return
    proto.write(b'{"ready": true}\n')
    reference = None

    def progress(i: int) -> None:
        proto.write(b'{"at": %d}\n' % i)

    while True:
        try:
            n, mode = struct.unpack("<II", _read_exact(inp, 8))
            lengths = struct.unpack(f"<{n}I", _read_exact(inp, 4 * n))
            blobs = [None if k == NONE else _read_exact(inp, k) for k in lengths]
        except EOFError:
            return                                    # the parent is gone or done
        try:
            if mode == REFERENCE:
                if reference is None:
                    from engine.decoders.pil import PilDecoder

                    reference = PilDecoder(spec, cfg["batch_size"], 1)
                arr, failed = reference.decode(blobs, progress)
            elif "progress" in inspect.signature(dec.decode).parameters:
                arr, failed = dec.decode(blobs, progress)
            else:
                progress(-1)                          # no per-image progress: the whole batch at once
                arr, failed = dec.decode(blobs)
            view = np.frombuffer(shared, np.uint8, count=arr.size).reshape(arr.shape)
            view[...] = arr
            msg = {"failed": {str(k): v for k, v in failed.items()}}
        except Exception as e:  # noqa: BLE001 - the parent redoes the batch with the reference
            msg = {"error": f"{type(e).__name__}: {e}"}
        try:
            proto.write((json.dumps(msg) + "\n").encode())
        except OSError:
            return                                    # the parent is gone
