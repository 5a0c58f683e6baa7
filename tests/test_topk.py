"""Tests of kernels/topk.py: the reference against brute force, the dispatcher, and the
CUDA source (compiled by nvcc, and run as C++ on CPU threads), plus GPU tests by marker."""

import itertools
import json
import math
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.io import write_atomic
from kernels import topk as topk_mod
from kernels.topk import KERNEL_SOURCE, MAX_K, store_compiled, to_host, topk, topk_cupy, topk_reference

SHAPES = [(1, 1), (3, 7), (5, 100), (17, 1000)]
KS = [1, 5, 50]
DTYPES = [torch.float32, torch.float16]
EXCLUDE = [False, True]
CASES = list(itertools.product(SHAPES, KS, DTYPES, EXCLUDE))
CASE_IDS = [f"{q}x{n}-k{k}-{str(d)[6:]}-{'ex' if e else 'noex'}" for (q, n), k, d, e in CASES]


def make_scores(n_rows, n_cols, dtype, seed=0):
    """Random scores with planted ties, NaN, +-inf and -0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, n_cols, generator=g)
    x[::2] = torch.round(x[::2] * 2) / 2  # even rows on a 0.5 grid: many ties
    x[1::4] = torch.randint(0, 3, x[1::4].shape, generator=g).float()  # 3 values: ties at every cut
    u = torch.rand(n_rows, n_cols, generator=g)
    x[u < 0.05] = float("nan")
    x[(u >= 0.05) & (u < 0.07)] = float("-inf")
    x[(u >= 0.07) & (u < 0.08)] = -0.0
    x[(u >= 0.08) & (u < 0.085)] = float("inf")
    if n_cols >= 3:  # a tie at the top of every row: index order decides
        x[:, [n_cols - 1, n_cols // 2, 0]] = 9.0
    return x.to(dtype)


def brute_topk(scores, k, exclude=None):
    """Independent answer: Python's sorted on (-score, index), NaN as -inf, pad (-inf, -1)."""
    rows = scores.double().numpy()
    values, indices = [], []
    for r, row in enumerate(rows):
        ex = -1 if exclude is None else int(exclude[r])
        keyed = sorted((-(-math.inf if math.isnan(v) else v), j) for j, v in enumerate(row) if j != ex)
        best = keyed[:k]
        pad = k - len(best)
        values.append([-s for s, _ in best] + [-math.inf] * pad)
        indices.append([j for _, j in best] + [-1] * pad)
    values = torch.tensor(values, dtype=torch.float32).reshape(-1, k)
    indices = torch.tensor(indices, dtype=torch.int64).reshape(-1, k)
    return values, indices


def case_seed(shape, k):
    return 1000 * shape[0] + shape[1] + k


def make_exclude(scores, seed=1):
    """Random exclusions with some -1; row 0 excludes its true best column."""
    n_rows, n_cols = scores.shape
    g = torch.Generator().manual_seed(seed)
    ex = torch.randint(-1, n_cols, (n_rows,), generator=g)
    ex[0] = brute_topk(scores[:1], 1)[1][0, 0]
    return ex


def case_inputs(shape, k, dtype, with_exclude, seed):
    scores = make_scores(*shape, dtype, seed=seed)
    exclude = make_exclude(scores, seed=seed + 1) if with_exclude else None
    return scores, exclude


def assert_same(got, want):
    gv, gi = got
    wv, wi = want
    assert gv.dtype == torch.float32 and gi.dtype == torch.int64
    assert gi.shape == wi.shape
    assert torch.equal(gi.cpu(), wi), f"indices differ:\n{gi.cpu()}\n{wi}"
    torch.testing.assert_close(gv.cpu(), wv, rtol=0, atol=0)


# ---------------------------------------------------------------- reference vs brute force


@pytest.mark.parametrize("shape, k, dtype, with_exclude", CASES, ids=CASE_IDS)
def test_reference_matches_brute_force(shape, k, dtype, with_exclude):
    scores, exclude = case_inputs(shape, k, dtype, with_exclude, seed=case_seed(shape, k))
    before = scores.clone()
    got = topk_reference(scores, k, exclude)
    assert_same(got, brute_topk(scores, k, exclude))
    assert torch.equal(scores.isnan(), before.isnan())  # input untouched (NaN stays NaN)


def test_reference_chunking_does_not_change_the_answer():
    scores, exclude = case_inputs((17, 1000), 50, torch.float32, True, seed=3)
    assert_same(topk_reference(scores, 50, exclude, rows_per_chunk=4), brute_topk(scores, 50, exclude))


def test_tie_break_and_nan_rules_by_hand():
    scores = torch.tensor([[1.0, float("nan"), 2.0, 1.0, 2.0, float("-inf")]])
    values, indices = topk_reference(scores, 6)
    # 2.0 at 2 and 4 (lower index first), 1.0 at 0 and 3, then -inf at 5 before NaN(=-inf) at 1
    assert indices.tolist() == [[2, 4, 0, 3, 1, 5]]  # NaN at 1 ties -inf at 5: lower index wins
    assert values.tolist() == [[2.0, 2.0, 1.0, 1.0, -math.inf, -math.inf]]
    values, indices = topk_reference(scores, 3, exclude=[2])
    assert indices.tolist() == [[4, 0, 3]]


def test_padding_rules():
    # 1x1 with its only column excluded: nothing eligible, all padding
    values, indices = topk_reference(torch.tensor([[0.5]]), 3, exclude=[0])
    assert indices.tolist() == [[-1, -1, -1]]
    assert values.tolist() == [[-math.inf] * 3]
    # k == N with an exclusion: the last slot is padding; without one, all N come back
    s = torch.tensor([[0.1, 0.3, 0.2], [0.1, 0.3, 0.2]])
    _, indices = topk_reference(s, 3, exclude=[1, -1])
    assert indices.tolist() == [[2, 0, -1], [1, 2, 0]]
    # k == 0: an empty [Q, 0]
    values, indices = topk_reference(s, 0)
    assert values.shape == (2, 0) and indices.shape == (2, 0)


def test_reference_accepts_numpy():
    scores = make_scores(5, 100, torch.float16, seed=7)
    exclude = np.array([3, -1, 0, 99, 50])
    got = topk_reference(scores.numpy(), 5, exclude)
    assert_same(got, brute_topk(scores, 5, exclude))


@pytest.mark.parametrize(
    "exclude, error",
    [([0, 1], ValueError), ([7, 0, 0], ValueError), ([-2, 0, 0], ValueError)],
)
def test_reference_rejects_bad_exclude(exclude, error):
    with pytest.raises(error):
        topk_reference(torch.zeros(3, 7), 2, exclude)


def test_reference_rejects_bad_scores():
    with pytest.raises(ValueError):
        topk_reference(torch.zeros(7), 2)
    with pytest.raises(TypeError):
        topk_reference(torch.zeros(3, 7, dtype=torch.int32), 2)
    with pytest.raises(ValueError):
        topk_reference(torch.zeros(3, 7), -1)


# ---------------------------------------------------------------- dispatcher


@pytest.fixture
def fresh_fallback_messages(monkeypatch):
    monkeypatch.setattr(topk_mod, "_said", set())
    monkeypatch.delenv("KERNELS_TOPK", raising=False)


def test_topk_on_cpu_falls_back_and_says_why_once(fresh_fallback_messages, capsys):
    scores, exclude = case_inputs((3, 7), 5, torch.float32, True, seed=5)
    assert_same(topk(scores, 5, exclude), brute_topk(scores, 5, exclude))
    topk(scores, 5, exclude)
    err = capsys.readouterr().err
    assert err.count("using the torch reference") == 1 and "not CUDA" in err


def test_the_caller_chooses_the_backend_and_names_its_switch(fresh_fallback_messages, monkeypatch, capsys):
    from engine import settings

    monkeypatch.setenv("KERNELS_TOPK", "torch")  # read by the engine's settings, never by kernels/
    backend = settings.topk_backend()
    scores = make_scores(3, 7, torch.float16)
    for _ in range(2):
        assert_same(topk(scores, 5, backend=backend, backend_from="KERNELS_TOPK"), brute_topk(scores, 5))
    assert capsys.readouterr().err == "kernels.topk: using the torch reference: KERNELS_TOPK=torch\n"
    assert_same(topk(scores, 5, backend="torch"), brute_topk(scores, 5))  # an argument alone: silent
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("KERNELS_TOPK", "fast")
    with pytest.raises(settings.SettingsError, match="KERNELS_TOPK"):
        settings.topk_backend()


def test_topk_explicit_backends(fresh_fallback_messages):
    scores = make_scores(3, 7, torch.float32)
    assert_same(topk(scores, 5, backend="torch"), brute_topk(scores, 5))
    with pytest.raises(ValueError):
        topk(scores, 5, backend="triton")
    with pytest.raises(ValueError, match="CUDA"):  # the kernel never runs on CPU tensors
        topk(scores, 5, backend="cupy")


def test_topk_cupy_validates_before_importing_cupy():
    with pytest.raises(ValueError, match="CUDA"):
        topk_cupy(torch.zeros(2, 3), 1)


# ---------------------------------------------------------------- first-call check (fake kernels)
# The kernel's launch (`_launch`) is replaced by a torch stand-in and the guard's CUDA/CuPy
# test (`_cupy_unavailable`) by an accept-all, so the dispatcher's kernel branch runs on CPU.


@pytest.fixture
def fake_kernel(fresh_fallback_messages, monkeypatch):
    """Install a fake launch: `install(answer)` where answer(t, k, ex) -> (values, indices);
    returns the list of launches made (row counts)."""
    monkeypatch.setattr(topk_mod, "_trusted", set())
    monkeypatch.setattr(topk_mod, "_distrust", [])
    monkeypatch.setattr(topk_mod, "_cupy_unavailable", lambda t, k: None)
    launches = []

    def install(answer):
        def launch(t, ex, k, values, indices, stored):
            launches.append(t.shape[0])
            v, i = answer(t, k, ex)
            values.copy_(v)
            indices.copy_(i)

        monkeypatch.setattr(topk_mod, "_launch", launch)
        return launches

    return install


def _swapped_ties(t, k, ex):
    """The reference's answer with the first two columns swapped: a wrong tie order."""
    v, i = topk_mod._reference(t, k, ex)
    return v[:, [1, 0, *range(2, k)]], i[:, [1, 0, *range(2, k)]]


def test_a_mismatching_kernel_is_dropped_for_the_run_with_one_line(fake_kernel, capsys):
    launches = fake_kernel(_swapped_ties)
    scores, exclude = case_inputs((17, 1000), 5, torch.float32, True, seed=5)
    for _ in range(3):
        assert_same(topk(scores, 5, exclude), brute_topk(scores, 5, exclude))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "failed its first-call check" in err and "differ in" in err
    assert launches == [min(17, topk_mod.CHECK_ROWS)]  # the check's one launch; never again
    assert_same(topk(scores.half(), 5, exclude), brute_topk(scores.half(), 5, exclude))
    assert launches == [8] and capsys.readouterr().err == ""  # other dtypes too, silently


def test_a_kernel_that_raises_is_dropped_with_one_line(fake_kernel, capsys):
    def broken(t, k, ex):
        raise RuntimeError("no kernel image is available for execution on the device\nsecond line")

    fake_kernel(broken)
    scores = make_scores(5, 100, torch.float16)
    assert_same(topk(scores, 5), brute_topk(scores, 5))
    assert_same(topk(scores, 5), brute_topk(scores, 5))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "raised RuntimeError: no kernel image" in err and "second line" not in err


def test_a_kernel_whose_ties_are_wrong_only_in_the_tie_case_is_dropped(fake_kernel, capsys):
    # tie-free call data passes; the planted tie-heavy matrix catches the wrong tie order
    def wrong_on_ties(t, k, ex):
        return _swapped_ties(t, k, ex) if t.shape[0] == 4 else topk_mod._reference(t, k, ex)

    launches = fake_kernel(wrong_on_ties)
    scores = torch.randn(16, 500, generator=torch.Generator().manual_seed(2))
    assert_same(topk(scores, 7), brute_topk(scores, 7))
    assert launches == [8, 4] and "a tie-heavy matrix" in capsys.readouterr().err


def test_a_matching_kernel_is_kept_without_a_word(fake_kernel, capsys):
    launches = fake_kernel(topk_mod._reference)
    for dtype in DTYPES:
        scores, exclude = case_inputs((17, 1000), 50, dtype, True, seed=6)
        for _ in range(2):
            assert_same(topk(scores, 50, exclude), brute_topk(scores, 50, exclude))
    # per dtype: the check's two launches (call rows, tie case), then one per call
    assert launches == [8, 4, 17, 17] * 2
    assert capsys.readouterr().err == ""


SYNCS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")


def _count_host_reads(monkeypatch, fn):
    """How many times fn() reads a tensor's value into Python (each is a host sync on CUDA)."""
    reads = []
    with monkeypatch.context() as m:
        for name in SYNCS:
            def counted(self, *a, _orig=getattr(torch.Tensor, name), _name=name, **kw):
                reads.append(_name)
                return _orig(self, *a, **kw)

            m.setattr(torch.Tensor, name, counted)
        out = fn()
    return reads, out


def test_a_kernel_call_reads_the_device_at_most_once(fake_kernel, monkeypatch):
    fake_kernel(topk_mod._reference)
    scores, exclude = case_inputs((17, 1000), 50, torch.float32, True, seed=8)
    topk(scores, 50, exclude)  # the first call runs the check (its syncs are once per process)
    reads, got = _count_host_reads(monkeypatch, lambda: topk(scores, 50, exclude))
    assert reads == ["tolist"]  # the exclusion's (min, max), read in one transfer
    assert_same(got, brute_topk(scores, 50, exclude))
    assert _count_host_reads(monkeypatch, lambda: topk(scores, 50))[0] == []
    host = exclude.numpy()
    assert _count_host_reads(monkeypatch, lambda: topk(scores, 50, host))[0] == []  # checked on the host
    with pytest.raises(ValueError, match="exclude values"):
        topk(scores, 50, torch.full((17,), 1000))


def test_to_host_waits_once_for_values_and_indices(monkeypatch):
    copies, waits = [], []

    class DeviceTensor:  # a CUDA tensor as to_host sees it
        is_cuda, device = True, torch.device("cuda", 0)

        def __init__(self, host):
            self.host = host

        def to(self, device, non_blocking=False):
            copies.append((device, non_blocking))
            return self.host

    class Stream:
        def synchronize(self):
            waits.append(1)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    v, i = to_host(DeviceTensor(torch.zeros(2, 3)), DeviceTensor(torch.ones(2, 3, dtype=torch.int64)))
    assert copies == [("cpu", True), ("cpu", True)] and waits == [1]
    assert v.dtype == torch.float32 and i.dtype == torch.int64
    assert [t.tolist() for t in to_host(torch.ones(1))] == [[1.0]]  # host tensors pass through


# ---------------------------------------------------------------- the stored module (fake CuPy)


class FakeCupy:
    """What kernels.topk uses of CuPy: Device, the NVRTC compiler, RawModule; records each use."""

    def __init__(self, arch="90", binary=b"\x7fELF fake cubin"):
        self.compiled, self.modules = [], []
        self.arch, self.binary = arch, binary
        fake = self
        cupy: Any = types.ModuleType("cupy")      # fake modules: their attributes are set here
        cuda: Any = types.ModuleType("cupy.cuda")
        compiler: Any = types.ModuleType("cupy.cuda.compiler")
        cupy.__version__ = "14.2.0"
        cupy.cuda, cuda.compiler = cuda, compiler
        self.cupy, self.cuda, self.compiler = cupy, cuda, compiler

        class Device:
            def __init__(self, index=0):
                self.compute_capability = fake.arch

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        class RawModule:
            def __init__(self, code=None, path=None, options=()):
                fake.modules.append("nvrtc" if code is not None else Path(path).name)
                self.path = path

            def get_function(self, name):
                if self.path is not None and Path(self.path).read_bytes().startswith(b"bad"):
                    raise RuntimeError("CUDA_ERROR_INVALID_IMAGE: device kernel image is invalid")
                return name

        def compile_using_nvrtc(source, options=()):
            fake.compiled.append(options)
            return fake.binary, None

        cuda.Device, cupy.RawModule, compiler.compile_using_nvrtc = Device, RawModule, compile_using_nvrtc

    def install(self, monkeypatch):
        for name, mod in (("cupy", self.cupy), ("cupy.cuda", self.cuda), ("cupy.cuda.compiler", self.compiler)):
            monkeypatch.setitem(sys.modules, name, mod)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(topk_mod, "_modules", {})
        monkeypatch.setattr(topk_mod, "_said", set())
        return self


def test_the_build_stores_the_compiled_kernel_and_says_what(monkeypatch, tmp_path):
    fake = FakeCupy().install(monkeypatch)
    record = store_compiled(tmp_path / "kernels", write=write_atomic)
    assert fake.compiled == [topk_mod.NVRTC_OPTIONS]
    assert record["stored"] and record["file"] == "topk-sm90.cubin" and record["format"] == "cubin"
    assert record["arch"] == "90" and record["source_sha256"] == topk_mod.SOURCE_SHA256
    assert record["functions"] == ["topk_f32", "topk_f16"] and record["cupy"] == "14.2.0"
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == ["topk-sm90.cubin", "topk.json"]
    assert json.loads((tmp_path / "kernels" / "topk.json").read_text()) == record
    assert (tmp_path / "kernels" / "topk-sm90.cubin").read_bytes() == fake.binary


def test_the_build_writes_through_the_callers_writer(monkeypatch, tmp_path):
    FakeCupy().install(monkeypatch)
    written = []

    def write(path, data):
        written.append(path.name)
        path.write_bytes(data)

    record = store_compiled(tmp_path, write=write)
    assert written == ["topk-sm90.cubin", "topk.json"] and json.loads((tmp_path / "topk.json").read_text()) == record
    assert topk_mod.stored_module(tmp_path, "90") == (tmp_path / "topk-sm90.cubin", None)


def test_ptx_from_nvrtc_is_stored_as_ptx(monkeypatch, tmp_path):
    FakeCupy(binary=".version 8.0\n.target sm_90\n").install(monkeypatch)
    record = store_compiled(tmp_path, write=write_atomic)
    assert record["file"] == "topk-sm90.ptx" and record["format"] == "ptx"


def test_nothing_is_stored_without_cuda_or_when_the_compile_fails(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert store_compiled(tmp_path / "a", write=write_atomic) == {"stored": False, "reason": "no CUDA device"}
    fake = FakeCupy().install(monkeypatch)

    def fails(source, options=()):
        raise RuntimeError("nvrtc: error: invalid value for --gpu-architecture")

    fake.compiler.compile_using_nvrtc = fails
    record = store_compiled(tmp_path / "b", write=write_atomic)
    assert record["stored"] is False and "NVRTC compile failed (RuntimeError: nvrtc: error" in record["reason"]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_run_loads_the_stored_kernel_without_nvrtc(monkeypatch, tmp_path, capsys):
    fake = FakeCupy().install(monkeypatch)
    store_compiled(tmp_path, write=write_atomic)
    assert topk_mod._functions(tmp_path, 0) == {"topk_f32": "topk_f32", "topk_f16": "topk_f16"}
    topk_mod._functions(tmp_path, 0)  # cached: loaded once
    assert fake.modules == ["topk-sm90.cubin"] and capsys.readouterr().err == ""


def _tamper(folder, what):
    record = json.loads((folder / "topk.json").read_text())
    if what == "binary":
        (folder / record["file"]).write_bytes(b"\x7fELF other")
    elif what == "missing binary":
        (folder / record["file"]).unlink()
    elif what == "record":
        (folder / "topk.json").write_text("{not json")
    elif what == "name":
        record["file"] = "../elsewhere.cubin"
    else:
        record[what] = "80" if what == "arch" else "0" * 64
    if what in ("name", "arch", "source_sha256"):
        (folder / "topk.json").write_text(json.dumps(record))


@pytest.mark.parametrize("what, why", [
    ("absent", "topk.json is missing"),
    ("record", "topk.json is unreadable"),
    ("name", "names no plain file"),
    ("source_sha256", "compiled from another kernel source"),
    ("arch", "compiled for sm_80, this GPU is sm_90"),
    ("missing binary", "topk-sm90.cubin is missing"),
    ("binary", "does not match its recorded SHA-256"),
])
def test_an_unusable_stored_kernel_is_compiled_once_and_said_once(monkeypatch, tmp_path, capsys, what, why):
    fake = FakeCupy().install(monkeypatch)
    folder = tmp_path / "kernels"
    if what != "absent":
        store_compiled(folder, write=write_atomic)
        _tamper(folder, what)
    binary, reason = topk_mod.stored_module(folder, "90")
    assert binary is None and why in reason
    topk_mod._functions(folder, 0)
    topk_mod._functions(folder, 1)  # a second device compiles too, without a second line
    err = capsys.readouterr().err
    assert fake.modules == ["nvrtc", "nvrtc"]
    assert err.count("\n") == 1 and "compiling the kernel with NVRTC" in err and why in err


def test_a_stored_kernel_the_driver_refuses_is_compiled_instead(monkeypatch, tmp_path, capsys):
    fake = FakeCupy(binary=b"bad image").install(monkeypatch)
    store_compiled(tmp_path, write=write_atomic)
    assert topk_mod.stored_module(tmp_path, "90") == (tmp_path / "topk-sm90.ptx", None)  # the file itself is intact
    topk_mod._functions(tmp_path, 0)
    assert fake.modules == ["topk-sm90.ptx", "nvrtc"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "loading" in err and "CUDA_ERROR_INVALID_IMAGE" in err


def test_no_stored_folder_compiles_silently(monkeypatch, capsys):
    fake = FakeCupy().install(monkeypatch)
    topk_mod._functions(None, 0)
    assert fake.modules == ["nvrtc"] and capsys.readouterr().err == ""


# ---------------------------------------------------------------- python -m kernels.topk


def test_python_m_kernels_topk_checks_then_times(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kernels.topk", "--rows", "8", "--cols", "300", "--reps", "2",
                        "--device", "cpu", "--json"], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    checks = [line for line in lines if line.startswith("check ")]
    assert len(checks) == len(topk_mod.CHECK_SHAPES) and all(line.endswith("PASS") for line in checks)
    assert "k=1 " in checks[0] and "max|dv|=0 " in checks[0] and "idx=100.0%" in checks[0]
    assert any(" 3x7 " in line and "k=7 " in line for line in checks)  # k = n
    assert {"float16", "float32"} <= {w for line in checks for w in line.split()}
    table = lines.index("time 8x300 float16 k=50, with exclusions, median of 2:")
    timed = {line.split()[0]: line for line in lines[table + 2: table + 5]}  # implementation, device, ms
    assert [timed[n].split()[1] for n in ("torch.topk", "reference")] == ["cpu", "cpu"]
    assert float(timed["reference"].split()[2]) > 0 and "(the kernel runs on CUDA only)" in timed["cupy"]
    doc = json.loads(lines[-1])
    assert doc["ok"] and doc["device"] == "cpu" and [c["ok"] for c in doc["checks"]] == [True] * len(checks)
    assert [t["implementation"] for t in doc["timing"]["implementations"]] == ["torch.topk", "reference", "cupy"]


def test_python_m_kernels_topk_help_names_every_default():
    r = subprocess.run([sys.executable, "-m", "kernels.topk", "--help"], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0
    options = r.stdout.split("options:", 1)[1].split("\n\n", 1)[0]
    blocks = {}  # option -> its help text (an entry starts with "  -")
    for line in options.splitlines():
        if line.startswith("  -"):
            name = line.split()[0].rstrip(",")
            blocks[name] = line
        elif blocks:
            blocks[name] += " " + line.strip()
    assert set(blocks) == {"-h", "--device", "--rows", "--cols", "--k", "--dtype", "--reps", "--json"}
    assert all("(default:" in text for name, text in blocks.items() if name != "-h"), blocks
    assert "PASS or FAIL" in r.stdout


def _wrong_indices(scores, k, exclude=None, rows_per_chunk=None):
    """The reference's values with every index shifted by one column: a broken twin."""
    v, i = topk_reference(scores, k, exclude)
    return v, torch.where(i >= 0, (i + 1) % scores.shape[1], i)


def _swapped_tie_order(scores, k, exclude=None, rows_per_chunk=None):
    """The reference with its first two results swapped: right values, wrong tie order."""
    v, i = topk_reference(scores, k, exclude)
    order = [1, 0, *range(2, k)] if k > 1 else [0]
    return v[:, order], i[:, order]


@pytest.mark.parametrize("broken", [_wrong_indices, _swapped_tie_order])
def test_a_broken_reference_fails_its_check(monkeypatch, broken, capsys):
    monkeypatch.setattr(topk_mod, "topk_reference", broken)
    shapes = [(3, 7, 7, torch.float32, True, False), (17, 1000, 5, torch.float16, True, True)]
    cases = topk_mod.run_checks("cpu", kernel=False, shapes=shapes)
    lines = capsys.readouterr().out.splitlines()
    assert [c["ok"] for c in cases] == [False, False] and all(line.endswith("FAIL") for line in lines)
    assert topk_mod.main(["--device", "cpu", "--rows", "4", "--cols", "100", "--reps", "1"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_the_kernel_is_checked_against_the_reference_exactly(monkeypatch):
    """The kernel branch of the check on CPU: a stand-in kernel equal to the reference passes; one
    with a wrong tie order fails against the reference (and against torch.topk's tie rule)."""
    shape = (17, 1000, 5, torch.float16, True, True)
    assert "not CUDA" in topk_mod.check_shape(*shape, device="cpu", kernel=True)["cupy_skipped"]
    monkeypatch.setattr(topk_mod, "_refusal", lambda t, k: None)  # the stand-ins take CPU tensors
    monkeypatch.setattr(topk_mod, "topk_cupy", lambda s, k, ex: topk_reference(s, k, ex))
    case = topk_mod.check_shape(*shape, device="cpu", kernel=True)
    assert case["ok"] and case["cupy==reference"] == {"max_abs_diff": 0.0, "index_agreement": 1.0, "ok": True}
    assert "cupy==reference max|dv|=0 idx=100.0%" in topk_mod.check_line(case)
    monkeypatch.setattr(topk_mod, "topk_cupy", lambda s, k, ex: _swapped_tie_order(s, k, ex))
    case = topk_mod.check_shape(*shape, device="cpu", kernel=True)
    assert not case["ok"] and case["reference~torch.topk"]["ok"]
    assert not case["cupy==reference"]["ok"] and not case["cupy~torch.topk"]["ok"]
    assert topk_mod.check_line(case).endswith("FAIL")

    def raises(s, k, ex):
        raise RuntimeError("nvrtc: error: invalid value for --gpu-architecture\nsecond line")

    monkeypatch.setattr(topk_mod, "topk_cupy", raises)
    case = topk_mod.check_shape(*shape, device="cpu", kernel=True)
    line = topk_mod.check_line(case)
    assert not case["ok"] and "cupy raised RuntimeError: nvrtc: error" in line and "second line" not in line
    assert line.endswith("FAIL")


@pytest.mark.gpu
def test_python_m_kernels_topk_checks_the_kernel_on_gpu(capsys):
    need_gpu()
    assert topk_mod.main(["--device", "cuda", "--rows", "64", "--cols", "5000", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("cupy==reference max|dv|=0 idx=100.0%") == len(topk_mod.CHECK_SHAPES)
    assert out.count("PASS") == len(topk_mod.CHECK_SHAPES) and "FAIL" not in out
    assert [line.split()[:2] for line in out.splitlines() if line.startswith("  cupy")] == [["cupy", "cuda"]]


# ---------------------------------------------------------------- CUDA source on CPU


def test_kernel_source_compiles_with_nvcc(tmp_path):
    """nvcc --ptx for sm_90 (both dtype wrappers), then ptxas, which checks the inline PTX."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    src, ptx = tmp_path / "topk.cu", tmp_path / "topk.ptx"
    src.write_text(KERNEL_SOURCE)
    cmd = [nvcc, "--ptx", "-arch=sm_90", "-Werror", "all-warnings", "-o", str(ptx), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = ptx.read_text()
    assert ".entry topk_f32" in text and ".entry topk_f16" in text
    ptxas = shutil.which("ptxas")
    if ptxas is not None:
        proc = subprocess.run(
            [ptxas, "-arch=sm_90", str(ptx), "-o", str(tmp_path / "topk.cubin")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr


# The kernel's own source, run as C++ with one std::thread per CUDA thread: std::barrier
# stands in for __syncthreads and for each warp's shuffles, `static` for __shared__.
# It checks the kernel's logic (lists, merge, padding, tie order) on CPU; it says nothing
# of the GPU memory model or speed.
EMULATION_PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define TOPK_HOST_EMULATION 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(n)
#define __shared__ static

struct Dim3 { unsigned x = 0, y = 1, z = 1; };
static Dim3 blockIdx, blockDim;
static thread_local Dim3 threadIdx;
static std::unique_ptr<std::barrier<>> block_barrier;
static std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
static unsigned long long shfl_slots[32][32];  // [warp][lane]

static inline void __syncthreads() { block_barrier->arrive_and_wait(); }
static inline float __int_as_float(unsigned bits) { float f; std::memcpy(&f, &bits, 4); return f; }

template <typename V>
static V __shfl_down_sync(unsigned, V v, int off) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    std::memcpy(&shfl_slots[warp][lane], &v, sizeof(V));
    warp_barriers[warp]->arrive_and_wait();
    V out = v;
    if (lane + off < 32) std::memcpy(&out, &shfl_slots[warp][lane + off], sizeof(V));
    warp_barriers[warp]->arrive_and_wait();
    return out;
}

static float host_half_to_float(unsigned short h) {
    const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    float f;
    if (exp == 0) f = std::ldexp((float)mant, -24);
    else if (exp == 31) f = mant ? NAN : INFINITY;
    else f = std::ldexp((float)(mant | 0x400), exp - 25);
    return sign ? -f : f;
}
"""

EMULATION_MAIN = r"""
// usage: emu IN OUT; IN = int32 [rows, cols, k, is_half, block], scores, int64 exclude[rows]
int main(int argc, char** argv) {
    if (argc != 3) return 2;
    FILE* in = std::fopen(argv[1], "rb");
    int hdr[5];
    if (!in || std::fread(hdr, 4, 5, in) != 5) return 3;
    const int rows = hdr[0], cols = hdr[1], k = hdr[2], is_half = hdr[3], block = hdr[4];
    const size_t n = (size_t)rows * cols, elem = is_half ? 2 : 4;
    std::vector<unsigned char> scores(n * elem + 1);
    std::vector<long long> exclude(rows);
    if (std::fread(scores.data(), elem, n, in) != n) return 4;
    if (std::fread(exclude.data(), 8, rows, in) != (size_t)rows) return 5;
    std::fclose(in);
    std::vector<float> values((size_t)rows * k, 12345.0f);  // sentinels: every slot must be written
    std::vector<long long> indices((size_t)rows * k, -7);
    blockDim.x = block;
    for (int r = 0; r < rows; ++r) {  // blocks run one at a time: `static` shared state is per block
        blockIdx.x = r;
        block_barrier = std::make_unique<std::barrier<>>(block);
        warp_barriers.clear();
        for (int w = 0; w < block / 32; ++w) warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
        std::vector<std::thread> threads;
        for (int t = 0; t < block; ++t) {
            threads.emplace_back([&, t] {
                threadIdx.x = t;
                if (is_half)
                    topk_f16((const unsigned short*)scores.data(), exclude.data(), cols, k, values.data(), indices.data());
                else
                    topk_f32((const float*)scores.data(), exclude.data(), cols, k, values.data(), indices.data());
            });
        }
        for (auto& th : threads) th.join();
    }
    FILE* out = std::fopen(argv[2], "wb");
    std::fwrite(values.data(), 4, values.size(), out);
    std::fwrite(indices.data(), 8, indices.size(), out);
    std::fclose(out);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated_kernel(tmp_path_factory):
    """Build the host emulation of KERNEL_SOURCE once; skip without a C++20 compiler."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not on PATH")
    folder = tmp_path_factory.mktemp("topk_emu")
    src, exe = folder / "emu.cpp", folder / "emu"
    src.write_text(EMULATION_PRELUDE + KERNEL_SOURCE + EMULATION_MAIN)
    proc = subprocess.run(
        [gxx, "-std=c++20", "-O1", "-pthread", "-Wall", "-Werror", "-o", str(exe), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0 and "barrier" in proc.stderr and "No such file" in proc.stderr:
        pytest.skip("no C++20 <barrier>")
    assert proc.returncode == 0, proc.stderr

    def run(scores, k, exclude=None, block=64):
        n_rows, n_cols = scores.shape
        is_half = scores.dtype == torch.float16
        ex = np.full(n_rows, -1, np.int64) if exclude is None else np.asarray(exclude, np.int64)
        inp, out = folder / "in.bin", folder / "out.bin"
        with open(inp, "wb") as f:
            np.array([n_rows, n_cols, k, int(is_half), block], np.int32).tofile(f)
            scores.contiguous().numpy().tofile(f)
            ex.tofile(f)
        proc = subprocess.run([str(exe), str(inp), str(out)], capture_output=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        raw = out.read_bytes()
        values = np.frombuffer(raw[: 4 * n_rows * k], np.float32).reshape(n_rows, k)
        indices = np.frombuffer(raw[4 * n_rows * k :], np.int64).reshape(n_rows, k)
        return torch.from_numpy(values.copy()), torch.from_numpy(indices.copy())

    return run


@pytest.mark.parametrize("shape, k, dtype, with_exclude", CASES, ids=CASE_IDS)
def test_emulated_kernel_matches_reference(emulated_kernel, shape, k, dtype, with_exclude):
    scores, exclude = case_inputs(shape, k, dtype, with_exclude, seed=case_seed(shape, k))
    assert_same(emulated_kernel(scores, k, exclude), topk_reference(scores, k, exclude))


@pytest.mark.parametrize("block", [32, 256])
def test_emulated_kernel_block_sizes(emulated_kernel, block):
    # 256 is the launched block size; 32 is one warp (a single-warp merge)
    scores, exclude = case_inputs((4, 3000), MAX_K, torch.float16, True, seed=11)
    assert_same(emulated_kernel(scores, MAX_K, exclude, block=block), topk_reference(scores, MAX_K, exclude))


@pytest.mark.parametrize("block", [32, 256])
def test_emulated_kernel_ties_at_full_thread_lists(emulated_kernel, block):
    # Thread t scans columns t, t+block, ...; its list fills once it has seen k of them, and
    # a later tie with its k-th must lose to the lower index already held. Row 2 puts the
    # whole answer in thread 0 (every column j % block == 0 ties at 2.0), so the tails of
    # the per-thread lists matter, not only their heads.
    n = 64 * 256 + 7
    scores = torch.ones(3, n)
    scores[1, n // 2 :] = 2.0
    scores[2, ::block] = 2.0
    exclude = [10, -1, block]
    for k in (5, MAX_K):
        want = topk_reference(scores, k, exclude)
        assert want[1][1].tolist() == list(range(n // 2, n // 2 + k))
        assert want[1][2].tolist() == [block * i for i in range(k + 1) if i != 1][:k]
        assert_same(emulated_kernel(scores, k, exclude, block=block), want)


# ---------------------------------------------------------------- GPU


def need_gpu():
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("shape, k, dtype, with_exclude", CASES, ids=CASE_IDS)
def test_cupy_matches_reference(shape, k, dtype, with_exclude):
    need_gpu()
    scores, exclude = case_inputs(shape, k, dtype, with_exclude, seed=case_seed(shape, k))
    want = topk_reference(scores, k, exclude)
    ex = None if exclude is None else exclude.cuda()
    assert_same(topk_cupy(scores.cuda(), k, ex), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cupy_large_matches_reference_on_gpu(dtype):
    need_gpu()
    scores, exclude = case_inputs((300, 125_000), MAX_K, dtype, True, seed=21)
    scores, exclude = scores.cuda(), exclude.cuda()
    got = topk_cupy(scores, MAX_K, exclude)
    assert_same(got, tuple(t.cpu() for t in topk_reference(scores, MAX_K, exclude)))


@pytest.mark.gpu
def test_cupy_accepts_cupy_arrays_and_auto_picks_kernel(fresh_fallback_messages, capsys):
    need_gpu()
    import cupy

    scores = make_scores(5, 100, torch.float16).cuda()
    want = topk_reference(scores.cpu(), 5)
    assert_same(topk_cupy(cupy.from_dlpack(scores), 5), want)
    assert_same(topk(scores, 5), want)
    assert capsys.readouterr().err == ""  # no fallback on the fast path
