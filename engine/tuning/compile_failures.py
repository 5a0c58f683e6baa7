"""Why a compile failed: the candidate, or the machine?

A backend's compile can fail for a reason of the candidate (a shape or precision the backend
does not lower, a kernel that does not fit) or for a reason of the machine that no candidate
changes: a header the compiler does not find, a library the linker does not find, a compiler
that is missing or cannot run. `environmental` tells the second kind apart from the error and
the errors it was raised from (Inductor wraps the C++ compiler's output in CppCompileError,
then in InductorError); the search then drops the backend after one failure instead of
paying one doomed compile per candidate. A full disk or an exhausted memory is not counted:
what the search removes, or a smaller candidate, can change it.
"""
from __future__ import annotations

import errno
import re

COMPILERS = ("cc", "c++", "gcc", "g++", "clang", "clang++", "nvcc", "ld", "ld.gold", "ld.lld", "ptxas", "cmake",
             "ninja", "icx", "icpx")

# (pattern in the error's text, what it means): each one a fault of the machine, not of the graph
MARKERS = (
    (re.compile(r"fatal error: ([^\s:]+): No such file or directory"), "missing header {0}"),
    (re.compile(r"cannot find -l([\w.+-]+)"), "the linker cannot find library {0}"),
    (re.compile(r"error while loading shared libraries: (\S+?):"), "a compiler tool cannot load {0}"),
    (re.compile(r"(?:^|\W)(?:collect2|ld(?:\.\w+)?): (?:error|fatal error): (.{0,80})"), "the linker failed: {0}"),
    (re.compile(r"Failed to find C compiler"), "no C compiler found (CC unset and none on PATH)"),
    (re.compile(r"(?:unrecognized|unknown) (?:command[- ]line )?(?:option|argument) '([^']+)'"),
     "the compiler does not know option {0} (too old?)"),
    (re.compile(r"nvcc fatal\s*:\s*(.{0,80})"), "nvcc failed: {0}"),
)


def _chain(e: BaseException) -> list[BaseException]:
    """`e` and the errors it was raised from or during, outermost first (no cycles)."""
    out: list[BaseException] = []
    while e is not None and e not in out and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def environmental(e: BaseException) -> str | None:
    """A short reason when `e` shows a fault of the machine's toolchain (the same for every candidate
    of the backend), else None."""
    for err in _chain(e):
        if isinstance(err, OSError) and err.errno in (errno.ENOENT, errno.EACCES, errno.ENOEXEC):
            name = str(err.filename or "").rsplit("/", 1)[-1]
            if name in COMPILERS or name.startswith(("gcc-", "g++-", "clang-", "clang++-")):
                return f"the compiler {name} cannot run ({err.strerror or err})"
        text = str(err)
        for pattern, what in MARKERS:
            m = pattern.search(text)
            if m:
                return what.format(*(g.strip() for g in m.groups()))
    return None
