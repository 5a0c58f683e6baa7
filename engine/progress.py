"""Progress of a long step, on stderr only (stdout stays for results).

On a terminal a tqdm bar; otherwise (a log file, CI, a pipe) one plain line every
`every_s` seconds and one when the step ends, so a log shows the step is alive and how
fast it goes. ENGINE_PROGRESS (engine.settings) forces `bar`, `lines` or `off`. A step
that resumes counts from `initial` (units done before); its rate counts this run's units.

    with Progress(len(rows), "reference", unit="images") as bar:
        for row in rows:
            ...
            bar.update()
"""
from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


def _mode(stream: TextIO) -> str:
    from engine import settings

    mode = settings.progress()
    if mode == "auto":
        isatty = getattr(stream, "isatty", None)
        mode = "bar" if isatty is not None and isatty() else "lines"
    return mode


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


class Progress:
    """Counts `total` units of work (None: unknown), `initial` of them done before, and reports
    on `stream` (default stderr)."""

    def __init__(self, total: int | None, desc: str, unit: str = "it", every_s: float = 5.0,
                 stream: TextIO | None = None, mode: str | None = None, initial: int = 0):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.stream = stream or sys.stderr
        self.mode = mode or _mode(self.stream)
        self.n = self.initial = initial
        self._t0 = self._last = time.monotonic()
        self._lock = threading.Lock()
        self._bar = None
        if self.mode == "bar":
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is a base dependency; a trimmed install still gets lines
                self.mode = "lines"
            else:
                self._bar = tqdm(total=total, desc=desc, unit=f" {unit}", file=self.stream, leave=True,
                                 dynamic_ncols=True, initial=initial)

    def update(self, n: int = 1) -> None:
        """`n` more units done."""
        with self._lock:
            self.n += n
            if self._bar is not None:
                self._bar.update(n)
            elif self.mode == "lines" and time.monotonic() - self._last >= self.every_s:
                self._line()

    def _line(self, final: bool = False) -> None:
        now = time.monotonic()
        self._last = now
        dt = now - self._t0
        rate = (self.n - self.initial) / dt if dt > 0 else 0.0
        done = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        parts = [f"{self.desc}: {done} {self.unit}"]
        if self.total and not final:
            parts[0] += f" ({100 * self.n / self.total:.0f} %)"
        if final:
            parts.append(f"in {_seconds(dt)}")
        parts.append(f"{rate:.3g} {self.unit}/s")
        if final and self.initial:
            parts.append(f"{self.initial} done before")
        if self.total and not final and rate > 0 and self.n < self.total:
            parts.append(f"about {_seconds((self.total - self.n) / rate)} left")
        print(", ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        """End the bar, or print the closing line (count, time, rate)."""
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            elif self.mode == "lines" and self.n > self.initial:
                self._line(final=True)
            self.mode = "off"

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
