"""A benchmark's preparation, said on the terminal as it happens, past pytest's output capture.

The compute-bound benchmarks prepare before anything is timed: the first run fits a
checkpoint's head, writes the photo cohorts, answers them with the naive path and builds
three artifacts, one a measured search of up to 15 minutes (25-35 minutes on 2 cores in
all; BENCH_PREPARED=DIR keeps every piece for the next run, then a run is minutes). pytest
captures what a fixture prints and shows it only when something fails, so `Preparation`
suspends the capture around each step: its own lines (what starts, what it costs, a line a
minute while it runs, what it took) and the output of the builds it starts, which inherit
the terminal, appear as they happen. Nothing is timed while the capture is off.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

FIRST_RUN = "25-35 min on 2 cores"     # a checkpoint fit, the cohorts and their reference, three builds
HEARTBEAT_S = 60.0
_ROOTS: dict[str, Path] = {}


def prepared_root(tmp_path_factory) -> Path:
    """BENCH_PREPARED, else one temporary folder for the whole session: the benchmark modules
    share their checkpoint and artifacts (each names them the same), so none is built twice."""
    keep = os.environ.get("BENCH_PREPARED")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        return Path(keep)
    if "session" not in _ROOTS:
        _ROOTS["session"] = tmp_path_factory.mktemp("ti336")
    return _ROOTS["session"]


class Preparation:
    """Steps of one fixture's preparation, each said on the terminal (stderr) while pytest's
    capture is suspended."""

    def __init__(self, config, stream=None):
        self._config = config
        self._capman = config.pluginmanager.getplugin("capturemanager")
        self._stream = stream
        self._depth, self._lock = 0, threading.Lock()
        self.said: list[str] = []

    @contextlib.contextmanager
    def visible(self):
        """pytest's capture off inside the block (as capsys.disabled(), for any fixture scope);
        a nested block, or a line from the heartbeat, leaves it off."""
        with self._lock:
            self._depth += 1
            outer = self._depth == 1
        off = (self._capman.global_and_fixture_disabled() if outer and self._capman is not None
               else contextlib.nullcontext())
        try:
            with off:
                yield
        finally:
            with self._lock:
                self._depth -= 1

    def say(self, msg: str) -> None:
        line = f"bench: {msg}"
        self.said.append(line)
        with self.visible():
            self._end_pytests_line()
            print(line, file=self._stream or sys.stderr, flush=True)

    def _end_pytests_line(self) -> None:
        """A newline after pytest's progress characters (`..s`), so a line starts at the margin."""
        try:
            tw = self._config.get_terminal_writer()
        except (AssertionError, AttributeError):   # no terminal reporter (-p no:terminal)
            return
        if tw.width_of_current_line:
            tw.line()

    @contextlib.contextmanager
    def step(self, what: str, about: str = ""):
        """`what` said when it starts (with `about`: what it costs), every HEARTBEAT_S while it
        runs and when it ends, with its seconds; the block runs with the capture off, so the
        processes it starts write to the terminal too."""
        self.say(f"{what}{f' ({about})' if about else ''} ...")
        stop, t0 = threading.Event(), time.monotonic()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                self.say(f"{what}: still running, {time.monotonic() - t0:.0f} s")

        thread = threading.Thread(target=beat, daemon=True)
        with self.visible():            # the heartbeat runs only while the capture is off
            thread.start()
            try:
                yield
            except BaseException:
                self.say(f"{what}: failed after {time.monotonic() - t0:.0f} s")
                raise
            finally:
                stop.set()
                thread.join()
        self.say(f"{what}: done in {time.monotonic() - t0:.0f} s")
