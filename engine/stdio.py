"""Diagnostics that cannot take a run down: standard streams whose failures are swallowed.

A run's result is its output file; stderr that is a closed pipe, /dev/full or closed
altogether must not change it. `safe_std_streams` makes sure fds 0-2 are open (else
/dev/null: a file opened later must never land on fd 2, where native libraries write
their messages) and replaces sys.stdout / sys.stderr with writers that drop what they
cannot write.
"""
from __future__ import annotations

import io
import os
import sys


class QuietStream(io.TextIOBase):
    """A text stream that forwards to `inner` and swallows every error writing to it."""

    def __init__(self, inner):
        self.inner = inner

    def write(self, s: str) -> int:
        try:
            self.inner.write(s)
        except (OSError, ValueError, AttributeError):  # EPIPE, ENOSPC, closed, or no stream at all
            pass
        return len(s)

    def flush(self) -> None:
        try:
            self.inner.flush()
        except (OSError, ValueError, AttributeError):
            pass

    def isatty(self) -> bool:
        try:
            return bool(self.inner.isatty())
        except (OSError, ValueError, AttributeError):
            return False

    def fileno(self) -> int:
        return self.inner.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:
        return getattr(self.inner, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str:
        return getattr(self.inner, "errors", None) or "strict"

    def __getattr__(self, name: str):  # buffer, mode, ...: the wrapped stream's own
        return getattr(self.inner, name)


def safe_std_streams() -> None:
    """fds 0-2 open (closed ones get /dev/null) and sys.stdout / sys.stderr quiet on failure."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            nul = os.open(os.devnull, os.O_RDWR)
            if nul != fd:
                os.dup2(nul, fd)
                os.close(nul)
    if not isinstance(sys.stdout, QuietStream):
        sys.stdout = QuietStream(sys.stdout)
    if not isinstance(sys.stderr, QuietStream):
        sys.stderr = QuietStream(sys.stderr)
