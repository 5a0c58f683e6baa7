"""Address-space limits, measured not guessed: each ABI passes at the need engine.memory states and
is refused one MiB below it in one line naming the limit and the need, before torch loads; what
still runs out (a MemoryError, a thread that cannot start) is one line too.

The at-the-limit runs are whole processes under RLIMIT_AS with ENGINE_THREADS=2 (the thread
count is part of the need), on the tiny test models. The need is measured on one machine (see
engine.memory); another maps more or less (CI's machines needed more than this one's estimate),
so at the need a run passes or ends in one line naming the limit, and with ROOM more it passes."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from cir_helpers import built_index, clip_dirs, corpus, run_args
from conftest import REPO

from engine import memory
from engine.memory import MiB

THREADS = "2"
ROOM = 512 * MiB        # above the need: what another machine may map beyond this one's measurement


def _limited(mib_bytes: int):
    def lim():
        resource.setrlimit(resource.RLIMIT_AS, (mib_bytes, resource.RLIM_INFINITY))
    return lim


def _one_error_line(r, prog: str, *needles: str) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith(f"{prog}: error:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def _threads(monkeypatch) -> int:
    from engine import threads

    monkeypatch.setenv("ENGINE_THREADS", THREADS)
    return threads.budget("cpu").peak(isolated_decoder=False)


def _passes_at_or_just_above_the_need(run, need: int, out: Path, prog: str):
    """At `need`: a whole run, or one line naming the limit and nothing written (a machine that maps
    more than the one measured); then with ROOM more, a whole run."""
    at = run(need, out)
    if at.returncode == 0:
        return
    _one_error_line(at, prog, f"the address-space limit is {need >> 20} MiB")
    assert not out.exists()
    roomy = run(need + ROOM, out)
    assert roomy.returncode == 0, roomy.stderr[-3000:]


# --- the estimate and its message ------------------------------------------------------------------

def test_the_need_is_fixed_plus_threads_plus_files(tmp_path, monkeypatch):
    from engine import settings

    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)     # the entry points' 1: no thread past the first
    settings.reload()
    (tmp_path / "a").write_bytes(bytes(3 * MiB))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_bytes(bytes(MiB))
    from engine.io import path_bytes

    base = memory.need_bytes(0, 100 * MiB)
    assert base == 100 * MiB + memory.MARGIN
    assert [path_bytes(tmp_path / n) for n in ("a", "d", "none")] == [3 * MiB, MiB, 0]
    assert memory.need_bytes(4 * MiB, 100 * MiB) == base + 4 * MiB
    assert memory.need_bytes(0, 100 * MiB, 5 * MiB) == base + 5 * MiB
    one = memory.THREAD_STACK + memory.MALLOC_ARENA          # a classification thread: stack and arena
    assert memory.thread_bytes(3, cpus=4) == 3 * one
    assert memory.thread_bytes(10, cpus=1) == 8 * one + 2 * memory.THREAD_PAST_ARENAS   # 8 arenas per CPU
    assert memory.retrieval_thread_bytes(7, 1) == memory.retrieval_thread_bytes(7, 2) == 14
    assert memory.decoder_bytes(None) == 0 < memory.decoder_bytes("pil") < memory.decoder_bytes("dali-cpu")


def test_the_need_counts_each_openblas_thread_past_the_first(monkeypatch):
    """numpy's OpenBLAS starts OPENBLAS_NUM_THREADS threads as numpy loads (one per CPU at most); the
    entry points set 1 unless the caller set it, and a value OpenBLAS cannot use is refused."""
    from engine import settings

    monkeypatch.setattr(settings, "usable_cpus", lambda: 4)

    def need(value: str | None) -> int:
        if value is None:
            monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OPENBLAS_NUM_THREADS", value)
        settings.reload()
        return memory.need_bytes(0, 100 * MiB)

    base = 100 * MiB + memory.MARGIN
    assert need(None) == need("1") == base
    assert need("2") == base + memory.OPENBLAS_THREAD
    assert need("64") == base + 3 * memory.OPENBLAS_THREAD
    for bad in ("0", "x"):
        with pytest.raises(settings.SettingsError, match="OPENBLAS_NUM_THREADS must be a whole number"):
            need(bad)
    settings.reload()


def test_the_check_names_the_limit_and_the_need_in_one_line(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (3000 * MiB, resource.RLIM_INFINITY))
    memory.check_address_space(3000 * MiB, "x")                       # at the limit: room enough
    with pytest.raises(memory.AddressSpaceError) as e:
        memory.check_address_space(3000 * MiB + 1, "a query run with 11 threads")
    assert str(e.value) == ("the address-space limit (3000 MiB, ulimit -v) is below the about 3001 MiB a query "
                            "run with 11 threads maps: raise the limit to at least that")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    memory.check_address_space(1 << 60, "x")                          # no limit: nothing to check


@pytest.mark.parametrize("error, says", [
    (MemoryError(), "out of memory (MemoryError: )"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: 12 bytes"),
     "out of memory (RuntimeError: [enforce fail"),
    (RuntimeError("can't start new thread"), "cannot start a thread (RuntimeError: can't start new thread)"),
    (RuntimeError("shape mismatch"), None),
    (ValueError("can't allocate memory"), None),
])
def test_running_out_is_told_from_other_errors(error, says):
    line = memory.exhaustion_line(error)
    assert (line is None) if says is None else (line.startswith(says) and "\n" not in line)


def test_a_missing_torch_names_the_interpreter_and_a_mapping_failure_the_memory_limit():
    missing = ModuleNotFoundError("No module named 'torch'", name="torch")
    assert memory.import_failure("torch", missing) == (
        f"cannot import torch (No module named 'torch'): the interpreter {sys.executable} has no torch installed")
    unmapped = ImportError("libtorch_cuda.so: failed to map segment from shared object")
    assert memory.import_failure("torch", unmapped).endswith("is the memory limit too low?")
    broken = ImportError("libc10.so: undefined symbol: _ZN3c10")
    assert memory.import_failure("torch", broken) == "cannot import torch (libc10.so: undefined symbol: _ZN3c10)"
    numpy_missing = ModuleNotFoundError("No module named 'numpy'", name="numpy")   # torch's dependency
    assert "memory" not in memory.import_failure("torch", numpy_missing)


def test_load_without_torch_names_the_interpreter_not_the_memory(eager_artifact):
    code = ("import sys; sys.modules['torch'] = None\nimport engine\n"
            "try:\n    engine.load(sys.argv[1], decoder='pil')\nexcept engine.LoadError as e:\n    print(e.stage, e)")
    r = subprocess.run([sys.executable, "-c", code, str(eager_artifact)], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("imports cannot import torch") and sys.executable in r.stdout, r.stdout
    assert "memory" not in r.stdout


# --- scripts/run at its limit ---------------------------------------------------------------------

@pytest.mark.abi
def test_scripts_run_passes_at_its_need_and_is_refused_just_below(small_cohort, eager_artifact, tmp_path,
                                                                   monkeypatch):
    from engine.classify.classifier import need_bytes_for

    need = need_bytes_for(eager_artifact, _threads(monkeypatch))     # dali-cpu runs in a child: not here
    m = small_cohort / "manifest.tsv"
    rows = len([ln for ln in m.read_text().splitlines() if ln.strip()])
    env = {**os.environ, "ENGINE_ARTIFACT": str(eager_artifact), "ENGINE_THREADS": THREADS}

    def run(limit: int, out: Path):
        return subprocess.run([str(REPO / "scripts" / "run"), str(m), str(small_cohort), str(out)], env=env,
                              preexec_fn=_limited(limit), capture_output=True, text=True, timeout=300)

    below = run(need - MiB, tmp_path / "below.i32")
    _one_error_line(below, "run", f"({(need - MiB) >> 20} MiB, ulimit -v)", f"about {-(-need // MiB)} MiB")
    assert not (tmp_path / "below.i32").exists()
    _passes_at_or_just_above_the_need(run, need, tmp_path / "at.i32", "run")
    assert (tmp_path / "at.i32").stat().st_size == 4 * rows


# --- the retrieval ABIs at their limits -----------------------------------------------------------

def _cir_need(monkeypatch, fixed: int, *paths) -> int:
    from evaluator.cir.limits import need

    _threads(monkeypatch)
    return need(fixed, *paths)[0]


def _cir(name: str, args: list[str], limit: int):
    env = {**os.environ, "ENGINE_THREADS": THREADS, "CLIP_DEVICE": "cpu", "PYTHON": sys.executable,
           "CLIP_MODEL_DIR": str(clip_dirs()["open_clip"])}
    return subprocess.run([str(REPO / "scripts" / name), *args], env=env, preexec_fn=_limited(limit),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.abi
def test_run_sh_passes_at_its_need_and_is_refused_just_below(tmp_path, monkeypatch):
    index, clip = built_index(), clip_dirs()["open_clip"]
    need = _cir_need(monkeypatch, memory.RETRIEVAL_RUN, index, clip)
    queries = corpus() / "requests.jsonl"
    below = _cir("run.sh", run_args(queries, tmp_path / "below.jsonl"), need - MiB)
    _one_error_line(below, "scripts/run.sh", "address-space limit", f"about {-(-need // MiB)} MiB a query run")
    assert not (tmp_path / "below.jsonl").exists()
    _passes_at_or_just_above_the_need(lambda limit, out: _cir("run.sh", run_args(queries, out), limit), need,
                                      tmp_path / "at.jsonl", "scripts/run.sh")
    assert len((tmp_path / "at.jsonl").read_text().splitlines()) == len(queries.read_text().splitlines())


@pytest.mark.abi
def test_build_sh_passes_at_its_need_and_is_refused_just_below(tmp_path, monkeypatch):
    need = _cir_need(monkeypatch, memory.RETRIEVAL_BUILD, clip_dirs()["open_clip"])
    args = ["--corpus", str(corpus()), "--chunk-size", "64", "--batch-size", "32"]
    below = _cir("build.sh", [*args, "--index-dir", str(tmp_path / "below")], need - MiB)
    _one_error_line(below, "scripts/build.sh", "address-space limit", f"about {-(-need // MiB)} MiB an index build")
    assert not (tmp_path / "below" / "meta.json").exists()
    _passes_at_or_just_above_the_need(lambda limit, out: _cir("build.sh", [*args, "--index-dir", str(out.parent)], limit),
                                      need, tmp_path / "at" / "meta.json", "scripts/build.sh")
    assert (tmp_path / "at" / "meta.json").is_file()


# --- what still runs out is one line --------------------------------------------------------------

@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("can't start new thread")])
@pytest.mark.parametrize("module", ["evaluator.cir.run", "evaluator.cir.build"])
def test_running_out_inside_a_retrieval_call_is_one_line(module, error, monkeypatch, capsys):
    import importlib

    mod = importlib.import_module(module)

    def exhausted(*a, **k):
        raise error

    monkeypatch.setattr(mod, "_main", exhausted)
    assert mod.main(["--whatever"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"{mod.PROG}: error: ") and "Traceback" not in err
    assert ("out of memory" if isinstance(error, MemoryError) else "cannot start a thread") in err


@pytest.mark.abi
def test_scripts_run_under_an_interpreter_without_the_dependencies_names_it(tmp_path, small_cohort):
    """A bare virtual environment: one line naming that interpreter and what it lacks, no memory hint."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    r = subprocess.run([str(REPO / "scripts" / "run"), str(small_cohort / "manifest.tsv"), str(small_cohort),
                        str(tmp_path / "p.i32")], env={**os.environ, "PYTHON": str(python)},
                       capture_output=True, text=True, timeout=120)
    line = _one_error_line(r, "run", f"the interpreter {python} has no ")
    assert line.startswith("run: error: cannot import ") and "memory" not in line
    assert not (tmp_path / "p.i32").exists()


# --- threads a library starts by itself: capped before numpy loads, a SIGINT it raises blamed on no key -------

def test_the_shell_entries_give_openblas_one_thread_before_python_starts_and_keep_a_set_value():
    """numpy's OpenBLAS starts its threads as numpy loads; scripts/runtime_env.sh (sourced by every
    shell entry point) sets the budget's value first, and a value the caller set stays."""
    from engine import threads

    def sourced(env: dict) -> str:
        sourced_file = REPO.joinpath("scripts", "runtime_env.sh")    # sourced only: no entry point starts
        r = subprocess.run(["sh", "-c", '. "$1"; echo "$OPENBLAS_NUM_THREADS"', "sh", str(sourced_file)],
                           env={**env, "here": str(REPO)}, capture_output=True, text=True, timeout=30)
        return r.stdout.strip()

    bare = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    assert sourced(bare) == threads.OPENBLAS_THREADS == "1"
    assert sourced({**bare, "OPENBLAS_NUM_THREADS": "3"}) == "3"


def test_the_budget_fills_the_thread_variables_the_caller_left_unset(monkeypatch):
    from engine import threads

    monkeypatch.setenv("ENGINE_THREADS", "3")
    b = threads.budget("cpu")
    env = {"OMP_NUM_THREADS": "5", "OPENBLAS_NUM_THREADS": ""}
    assert threads.apply_library_env(b, env) == {**threads.library_env(b), "OMP_NUM_THREADS": "5"}
    assert env["OMP_NUM_THREADS"] == "5" and env["MKL_NUM_THREADS"] == "3" and env["OPENBLAS_NUM_THREADS"] == "1"


def test_the_retrieval_entries_read_their_flags_without_loading_numpy_or_torch():
    """The address-space check runs after the flags are read and before torch loads: reading them
    must load neither (torch maps about 3 GiB, and numpy's OpenBLAS starts threads as it loads)."""
    code = ("import sys\nfrom evaluator.cir import build, run\n"
            "run.parse_args(['--index-dir', 'i', '--queries', 'q', '--output', 'o'])\n"
            "build.parse_args(['--corpus', 'c', '--index-dir', 'i'])\n"
            "print(sorted(m for m in ('numpy', 'torch') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["[]"], r.stdout + r.stderr[-2000:]


def test_a_sigint_under_an_address_space_limit_names_the_limit_beside_ctrl_c(tmp_path):
    """A Python handler cannot see who sent SIGINT, and a library that cannot start a thread raises
    it at itself: under an address-space limit the line names that limit, not a key alone."""
    code = ("import resource, signal, sys\nfrom evaluator.cir.run import interrupt_ends\n"
            "resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]) << 20, resource.RLIM_INFINITY))\n"
            "with interrupt_ends('prog', 'rows kept'):\n    signal.raise_signal(signal.SIGINT)\n")
    r = subprocess.run([sys.executable, "-c", code, "6000"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 130 and r.stderr.splitlines() == [
        "prog: stopped by SIGINT (sent by Ctrl-C or a kill, or raised by a library that could not start a thread "
        "under the 6000 MiB address-space limit, ulimit -v): rows kept"], r.stderr[-2000:]


def test_the_contest_run_names_the_limit_beside_ctrl_c_for_sigint_only(monkeypatch):
    import signal

    from evaluator.contest.run import signal_named

    monkeypatch.setattr(resource, "getrlimit", lambda which: (3072 * MiB, resource.RLIM_INFINITY))
    assert signal_named(signal.SIGINT).startswith("SIGINT (sent by Ctrl-C or a kill, or raised by a library")
    assert "3072 MiB address-space limit" in signal_named(signal.SIGINT)
    assert signal_named(signal.SIGTERM) == "SIGTERM"
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert signal_named(signal.SIGINT) == "SIGINT"


@pytest.mark.abi
def test_a_query_run_under_3_gib_ends_in_one_line_naming_the_limit_never_an_interrupt(tmp_path):
    """Under 3 GiB, numpy's OpenBLAS could not start its second thread once torch was mapped and
    raised SIGINT, told as an interruption (exit 130). Now: a whole run, or one line naming the
    limit, exit 2, nothing written."""
    queries = corpus() / "requests.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}   # OpenBLAS left to size itself
    r = subprocess.run([str(REPO / "scripts" / "run.sh"), *run_args(queries, tmp_path / "o.jsonl")],
                       env={**env, "ENGINE_THREADS": THREADS, "CLIP_DEVICE": "cpu", "PYTHON": sys.executable},
                       preexec_fn=_limited(3072 * MiB), capture_output=True, text=True, timeout=300)
    assert "SIGINT" not in r.stderr, r.stderr[-3000:]
    if r.returncode == 0:
        assert len((tmp_path / "o.jsonl").read_text().splitlines()) == len(queries.read_text().splitlines())
        return
    _one_error_line(r, "scripts/run.sh", "address-space limit (3072 MiB")
    assert not (tmp_path / "o.jsonl").exists()
