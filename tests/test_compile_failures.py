"""engine.tuning.compile_failures.environmental: a fault of the machine's toolchain (the same for every
candidate of a backend) told apart from a fault of the candidate, on the error texts compilers,
linkers and Inductor write."""
from __future__ import annotations

import errno

import pytest

from engine.tuning.compile_failures import environmental


class CppCompileError(RuntimeError):
    """Stands in for torch._inductor's (its text: the command, then the compiler's output)."""


class InductorError(RuntimeError):
    pass


def _wrapped(inner: BaseException) -> BaseException:
    """`inner` raised inside Inductor, re-raised as an InductorError (as torch does)."""
    try:
        try:
            raise inner
        except BaseException as e:
            raise InductorError(f"{type(e).__name__}: C++ compile error") from e
    except InductorError as outer:
        return outer


@pytest.mark.parametrize("text, why", [
    ("/tmp/torchinductor/ab.cpp:2:10: fatal error: Python.h: No such file or directory\ncompilation terminated.",
     "missing header Python.h"),
    ("In file included from x.cpp:1:\n/usr/include/c10/util/x.h:4:10: fatal error: cuda_runtime_api.h: "
     "No such file or directory", "missing header cuda_runtime_api.h"),
    ("/usr/bin/ld: cannot find -lcuda: No such file or directory\ncollect2: error: ld returned 1 exit status",
     "the linker cannot find library cuda"),
    ("collect2: error: ld returned 1 exit status", "the linker failed: ld returned 1 exit status"),
    ("Failed to find C compiler. Please specify via CC environment variable.",
     "no C compiler found (CC unset and none on PATH)"),
    ("g++: error: unrecognized command-line option '-mamx-tile'", "the compiler does not know option -mamx-tile (too old?)"),
    ("nvcc fatal   : Unsupported gpu architecture 'compute_90a'", "nvcc failed: Unsupported gpu architecture 'compute_90a'"),
])
def test_toolchain_faults_are_environmental_also_when_inductor_wraps_them(text, why):
    assert environmental(CppCompileError(text)) == why
    assert environmental(_wrapped(CppCompileError(text))) == why


@pytest.mark.parametrize("name", ["g++", "/usr/bin/gcc", "nvcc", "clang++-17"])
def test_a_compiler_that_is_missing_or_cannot_run_is_environmental(name):
    for code in (errno.ENOENT, errno.EACCES):
        e = FileNotFoundError(code, "No such file or directory", name) if code == errno.ENOENT \
            else PermissionError(code, "Permission denied", name)
        why = environmental(_wrapped(e))
        assert why is not None and why.startswith(f"the compiler {name.rsplit('/', 1)[-1]} cannot run")


@pytest.mark.parametrize("e", [
    RuntimeError("planted: the backend cannot build this"),
    CppCompileError("/tmp/ab.cpp:120:5: error: 'tmp3' was not declared in this scope"),   # a code generation bug
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    OSError(errno.ENOSPC, "No space left on device"),           # what the search removes can free it
    FileNotFoundError(errno.ENOENT, "No such file or directory", ".search.x/aot_bf16_b64/model.so"),
    ValueError("aot options must be one of ('default', 'max-autotune'), got 'fast'"),
])
def test_faults_of_the_candidate_or_passing_conditions_are_not(e):
    assert environmental(e) is None
    assert environmental(_wrapped(e)) is None


def test_an_error_chain_with_a_cycle_ends():
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert environmental(a) is None
