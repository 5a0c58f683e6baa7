"""A CPU decoder in a child process: a native crash there costs one batch, not the run.

DALI's CPU decoder can crash the process when a sample fails inside it (its thread pool
outlives the error). The router keeps such files away from it, but a crash cannot be
ruled out for every input (an allocation failing under a memory cap is enough), so by
default (`ENGINE_DECODER_ISOLATE=1`) the decoders a module lists in `ISOLABLE` run here:

    parent                                    child (python -c ... engine.decoders.isolate)
      request: n, n lengths, n blobs  ──pipe──►  decoder.decode(blobs)
      reply:   {"failed": {...}}      ◄─pipe──   pixels -> shared memory (memfd), [n, S, S, 3] uint8

If the child dies, hangs past its deadline or cannot start, that batch is decoded by the
PIL reference in the parent (said on stderr) and a fresh child takes the next batch; after
MAX_RESTARTS crashes the reference decodes the rest. The child's stdout carries only the
protocol: its fd 1 is pointed at stderr, so a library that prints cannot corrupt it.
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
from pathlib import Path

import numpy as np

from engine.spec import Spec

MAX_RESTARTS = 5
NONE = 0xFFFFFFFF                    # length of a blob that was not read
_ROOT = str(Path(__file__).resolve().parents[2])   # the folder holding the engine package
_CHILD = ("import sys; sys.path.insert(0, sys.argv[1]); "
          "from engine.decoders.isolate import child_main; child_main()")


def deadline_s(n: int) -> float:
    """Seconds a batch of n images may take in the child before it counts as hung."""
    return 60.0 + 2.0 * n


class IsolatedDecoder:
    """The decoder `name` (from `module`) in a child process; the same `.decode` interface."""

    isolated = True

    def __init__(self, name: str, module: str, spec: Spec, batch_size: int, threads: int | None = None,
                 deadline=deadline_s):
        """`deadline(n)`: seconds a batch of n images may take before the child counts as hung."""
        from engine.decoders.pil import PilDecoder

        self.name, self.module, self.spec = name, module, spec
        self.batch_size, self.threads = batch_size, threads
        self._slot = batch_size * spec.input_size * spec.input_size * 3     # bytes of one [B, S, S, 3] batch
        self._reference = PilDecoder(spec, batch_size)
        self._proc = None
        self._map = None
        self._ready = False
        self.deadline = deadline
        self.crashes = 0
        self._start()

    # ------------------------------------------------------------ child management
    def _start(self) -> None:
        """Start a child (not waited for: it builds its pipeline while the caller loads the model)."""
        fd = os.memfd_create("decoded-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self._slot)
            self._map = mmap.mmap(fd, self._slot)
            config = {"module": self.module, "name": self.name, "spec": self.spec.to_dict(),
                      "batch_size": self.batch_size, "threads": self.threads, "fd": fd, "bytes": self._slot}
            self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, _ROOT], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, pass_fds=(fd,), close_fds=True)
        finally:
            os.close(fd)   # the parent keeps its mapping; the child has its own descriptor
        self._proc.stdin.write((json.dumps(config) + "\n").encode())
        self._proc.stdin.flush()
        self._ready = False

    def _reply(self, timeout: float) -> dict:
        """The child's next JSON line; RuntimeError when it died or stayed silent past `timeout`."""
        out = self._proc.stdout
        ready, _, _ = select.select([out], [], [], timeout)
        if not ready:
            raise RuntimeError(f"no answer within {timeout:.0f} s")
        line = out.readline()
        if not line:
            rc = self._proc.wait()
            why = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
            raise RuntimeError(f"the decoder process died ({why})")
        return json.loads(line)

    def _stop(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
            self._proc = None
        if self._map is not None:
            self._map.close()
            self._map = None

    def close(self) -> None:
        """Stop the child (it also leaves by itself when the parent's end of its pipe closes)."""
        self._stop()

    def __del__(self):
        try:
            self._stop()
        except Exception:  # noqa: BLE001 - interpreter teardown: nothing left to report to
            pass

    # ------------------------------------------------------------ decoding
    def decode(self, blobs: list[bytes | None]):
        """(uint8 [n, S, S, 3], {index: reason}); a batch the child cannot finish is decoded by PIL."""
        n = len(blobs)
        if n > self.batch_size:  # the shared slot holds one batch: larger requests go in pieces
            parts = [self.decode(blobs[i:i + self.batch_size]) for i in range(0, n, self.batch_size)]
            failed = {i + j * self.batch_size: why for j, (_, f) in enumerate(parts) for i, why in f.items()}
            return np.concatenate([a for a, _ in parts]), failed
        if self._proc is None:
            return self._reference.decode(blobs)
        if not self._ready and not self._hello():
            return self._reference.decode(blobs)
        try:
            lengths = [NONE if b is None else len(b) for b in blobs]
            self._proc.stdin.write(struct.pack(f"<{n + 1}I", n, *lengths))
            for b in blobs:
                if b:
                    self._proc.stdin.write(b)
            self._proc.stdin.flush()
            reply = self._reply(self.deadline(n))
            if "error" in reply:
                raise RuntimeError(reply["error"])
        except (OSError, ValueError, RuntimeError) as e:
            return self._crashed(blobs, e)
        s = self.spec.input_size
        arr = np.frombuffer(self._map, np.uint8, count=n * s * s * 3).reshape(n, s, s, 3).copy()
        return arr, {int(k): v for k, v in reply["failed"].items()}

    def _hello(self) -> bool:
        """Wait for the child's pipeline; a child that cannot build one is not restarted."""
        try:
            hello = self._reply(self.deadline(0))
            if "error" in hello:
                raise RuntimeError(hello["error"])
        except (OSError, ValueError, RuntimeError) as e:
            print(f"[engine] decoder {self.name} unavailable in its process ({e}); using pil", file=sys.stderr)
            self._stop()
            return False
        self._ready = True
        return True

    def _crashed(self, blobs, err: Exception):
        self.crashes += 1
        self._stop()
        again = self.crashes <= MAX_RESTARTS
        print(f"[engine] {self.name} (isolated): {err}; decoding this batch of {len(blobs)} with pil"
              + ("; starting a fresh decoder process" if again else
                 f"; {self.crashes} failures, pil decodes the rest"), file=sys.stderr)
        if again:
            try:
                self._start()
            except OSError as e:
                print(f"[engine] {self.name} (isolated): cannot start a decoder process ({e}); "
                      "pil decodes the rest", file=sys.stderr)
                self._stop()
        return self._reference.decode(blobs)


def _read_exact(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError
    return data


def child_main() -> None:
    """The child: build the decoder, then answer one request per batch until stdin closes."""
    import importlib

    from engine.streams import safe_std_streams

    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C is the parent's to handle
    proto = os.fdopen(os.dup(1), "wb", buffering=0)   # the protocol keeps the real stdout
    os.dup2(2, 1)                                     # anything else printed goes to stderr
    safe_std_streams()                                # a broken stderr must not fail a batch
    inp = sys.stdin.buffer
    cfg = json.loads(inp.readline())
    shared = mmap.mmap(cfg["fd"], cfg["bytes"])
    try:
        spec = Spec.from_dict(cfg["spec"])
        dec = importlib.import_module(cfg["module"]).create(cfg["name"], spec, cfg["batch_size"], cfg["threads"])
    except Exception as e:  # noqa: BLE001 - reported to the parent, which falls back
        proto.write((json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n").encode())
        return
    proto.write(b'{"ready": true}\n')
    while True:
        try:
            (n,) = struct.unpack("<I", _read_exact(inp, 4))
            lengths = struct.unpack(f"<{n}I", _read_exact(inp, 4 * n))
            blobs = [None if k == NONE else _read_exact(inp, k) for k in lengths]
        except EOFError:
            return                                    # the parent is gone or done
        try:
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
