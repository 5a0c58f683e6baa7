"""The CPU's int8 candidate (engine.core.int8): offered only where it can be built and said why
not otherwise, measured only on the quantizing backend, a row of an auto build's table, and (slow)
a real PT2E-quantized AOTInductor graph of the tiny model that runs oneDNN's int8 GEMMs, agrees
with FP32 within the guard and loads in a process that never imports torchao."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, tiny_spec
from test_autotune import Clock, FakeMeasurer, _context

from engine.tuning.autotune import Candidate, SearchConfig, search

VNNI = {"avx2", "avx512f", "avx512_vnni"}


@pytest.fixture
def no_torchao(monkeypatch):
    """torchao failing to import, as on a machine without it (a None entry blocks the import)."""
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)


def _native(monkeypatch, flags=VNNI, machine="x86_64"):
    from engine.core import int8
    from engine.tuning.measure import measurable_precisions

    monkeypatch.setattr(int8, "cpu_flags", lambda: flags)
    monkeypatch.setattr(int8.platform, "machine", lambda: machine)
    return measurable_precisions("cpu")


def test_int8_is_native_where_the_cpu_has_int8_dot_products_and_torchao_imports(monkeypatch):
    monkeypatch.delenv("ENGINE_INT8", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    got, skipped = _native(monkeypatch)
    assert "int8" in got and "int8" not in skipped
    for flags in ({"avx_vnni"}, {"amx_int8", "avx512f"}, {"avx2"}):   # AVX2 alone: measured, its row says if it pays
        assert "int8" in _native(monkeypatch, flags)[0]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")      # a CPU forced to AVX2 still measures it
    assert "int8" in _native(monkeypatch)[0]


@pytest.mark.parametrize("case, reason", [
    ("switch", "off (ENGINE_INT8=0)"),
    ("no-avx2", "no AVX2 on this CPU"),
    ("isa", "ONEDNN_MAX_CPU_ISA=AVX leaves oneDNN no int8 GEMMs"),
    ("arm", "X86InductorQuantizer needs an x86-64 CPU, this is aarch64"),
    ("torchao", "torchao does not import ("),
])
def test_int8_is_skipped_with_its_reason(monkeypatch, request, case, reason):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    if case == "switch":
        monkeypatch.setenv("ENGINE_INT8", "0")
    if case == "isa":
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX")
    if case == "torchao":
        request.getfixturevalue("no_torchao")
    got, skipped = _native(monkeypatch, {"avx", "sse4_2"} if case == "no-avx2" else VNNI,
                           "aarch64" if case == "arm" else "x86_64")
    assert "int8" not in got and skipped["int8"].startswith(reason), skipped
    assert "\n" not in skipped["int8"]


def _ctx(spec, **auto):
    """A CPU build's context asking `auto` (AutoConfig's fields) to measure."""
    from engine.tuning.command import AutoConfig
    from engine.tuning.context import BuildContext

    return BuildContext(spec, "cpu", auto=AutoConfig(**auto))


def test_int8_is_measured_on_the_quantizing_backend_only(monkeypatch):
    """--search-precisions int8 with a backend that cannot quantize is a skipped reason, not a failure;
    the off switch wins over --search-precisions; with aot and eager only aot/int8 candidates exist."""
    from engine.tuning.auto import search_config

    monkeypatch.delenv("ENGINE_INT8", raising=False)
    spec = tiny_spec()
    cfg, skipped = search_config(_ctx(spec, precisions=("fp32", "int8"), backend=False), "eager")
    assert cfg.precisions == ("fp32",) and "not eager" in skipped["int8"]
    monkeypatch.setattr("engine.tuning.measure.importable_backends", lambda device: (["aot", "eager"], {}))
    cfg, skipped = search_config(_ctx(spec, precisions=("fp32", "int8")), "aot")
    assert cfg.precisions == ("fp32", "int8") and cfg.only == {"int8": ("aot",)} and "int8" not in skipped
    clock = Clock()
    screen = {(p, b): 50.0 for p in ("fp32", "int8") for b in (8, 16)}
    graph = {(p, b, be, "default"): (90.0 if p == "int8" else 40.0) for p in ("fp32", "int8") for b in (8, 16)
             for be in ("aot", "eager")}
    fake = FakeMeasurer(clock, screen, graph, fraction=0.02, recheck=40.0)
    res = search(fake, SearchConfig(**{**cfg.__dict__, "batch_sizes": (8, 16), "options": ("default",),
                                       "compile_estimate_s": 0.0}), clock=clock)
    names = {t.candidate.name for t in res.trials}
    assert {"aot/int8/b8", "aot/int8/b16"} <= names and not any(n.startswith("eager/int8") for n in names)
    best = res.ranked[0]   # the fastest that holds, its re-checks priced at the FP32 re-check graph's rate
    assert best.candidate.precision == "int8" and best.recheck_images_per_s == 40.0
    assert best.effective_images_per_s == pytest.approx(1 / (1 / 90.0 + 0.02 / 40.0))
    monkeypatch.setenv("ENGINE_INT8", "0")
    from engine import settings

    settings.reload()
    cfg, skipped = search_config(_ctx(spec, precisions=("fp32", "int8")), "aot")
    assert cfg.precisions == ("fp32",) and skipped["int8"] == "off (ENGINE_INT8=0)"


def test_a_fixed_int8_build_with_a_backend_that_cannot_quantize_is_refused(tmp_path, monkeypatch):
    from engine.tuning.command import build

    with pytest.raises(ValueError, match="--precision int8 is built by a quantizing backend \\(aot\\), not eager"):
        build(tiny_spec(precision="int8"), tmp_path / "ck.safetensors", tmp_path / "art", backend="eager")
    assert not (tmp_path / "art").exists()


class _Int8Fake(FakeMeasurer):
    """Planted rates; eager candidates built for real (the build assembles one), aot ones only named."""

    def __init__(self, real, *args, **kw):
        clock = Clock()
        rates = _Rates()
        super().__init__(clock, rates, rates, fraction=0.02, recheck=30.0)
        self._real = real(*args, **kw)

    def compile(self, c):
        name = super().compile(c)
        return self._real.compile(c) if c.backend == "eager" else name

    def discard(self, h):
        if not isinstance(h, str):
            self._real.discard(h)


class _Rates(dict):
    """Any key's rate: eager FP32 fastest, everything compiled slower (so the build assembles eager FP32)."""

    def __missing__(self, key):
        if len(key) == 2:                 # a screen: (precision, batch)
            return 30.0
        p, b, backend, _ = key
        return 60.0 + b if (p, backend) == ("fp32", "eager") else 20.0


@pytest.mark.parametrize("switch", ["1", "0"])
def test_an_auto_build_lists_the_int8_candidate_or_why_it_was_skipped(tmp_path, tiny_checkpoint, monkeypatch,
                                                                       switch):
    from engine import settings
    from engine.core import int8
    from engine.tuning import AutoConfig, GuardConfig, build
    from engine.tuning import auto as build_auto
    from engine.tuning import measure as autotune_measure

    monkeypatch.setenv("ENGINE_INT8", switch)
    settings.reload()
    monkeypatch.setattr(int8, "cpu_flags", lambda: VNNI)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")   # bf16 not native: fp32, int8
    real = autotune_measure.Measurer
    monkeypatch.setattr(autotune_measure, "Measurer", lambda *a, **k: _Int8Fake(real, *a, **k))
    monkeypatch.setattr(autotune_measure, "importable_backends", lambda device: (["aot", "eager"], {}))
    monkeypatch.setattr(build_auto, "verify_artifact", lambda *a, **k: {"ok": True, "images": 16, "agreement": 1.0})
    meta = build(tiny_spec("squash", 16), tiny_checkpoint, tmp_path / "art", backend="aot", device="cpu",
                 guard=GuardConfig(calibration_source="renders", calibration_count=16),
                 auto=AutoConfig(budget_s=1000, deadline_s=3000))
    rec = meta["build"]["search"]
    rows = {r["name"]: r for r in rec["candidates"]}
    assert (meta["precision"], meta["backend"]) == ("fp32", "eager")
    if switch == "1":
        assert "int8" not in rec["skipped"]
        int8_rows = [r for n, r in rows.items() if r["precision"] == "int8"]
        assert int8_rows and all(r["backend"] == "aot" for r in int8_rows)
        assert any(r["images_per_s"] == 20.0 for r in int8_rows)    # compiled and timed
    else:
        assert rec["skipped"]["int8"] == "off (ENGINE_INT8=0)"
        assert not [r for r in rows.values() if r["precision"] == "int8"]


@pytest.mark.slow
def test_the_int8_graph_runs_onednn_int8_gemms_and_holds_the_guard(tmp_path, tiny_checkpoint):
    """A real PT2E quantization of the tiny model, compiled by AOTInductor with freezing (~2 min on two
    cores): its generated code calls oneDNN's quantized GEMMs, it holds the guard against the FP32 graph
    on natural photos, and its .so answers the same in a process that never imports torchao."""
    from engine.core.checkpoint import load_model
    from engine.core.int8 import import_problem
    from engine.core.model import wrap
    from engine.tuning import calibrate
    from engine.tuning.measure import Measurer

    if import_problem():
        pytest.skip(import_problem())
    spec = tiny_spec("squash", 8)
    net = load_model(spec, tiny_checkpoint)
    pixels = calibrate.photo_stream(spec).take(64)
    ref = calibrate.classify(wrap(net, spec, "cpu", margin=True), pixels, 16, margin=True, device="cpu")
    m = Measurer(_context(net, spec, pixels, ref), tmp_path / "work")
    c = Candidate("int8", 8, "aot")
    h = m.compile(c)
    assert "qlinear_pointwise" in h.extras["aot"]["quantized_kernels"], h.extras
    a = m.agree(h, c)
    assert a.holds and a.tau is not None and a.agreement >= 0.99, a
    top1, margins = calibrate.classify(h.fn, pixels[:8], 8, margin=True, device="cpu")
    np.save(tmp_path / "x.npy", pixels[:8])
    code = ("import sys, json, numpy as np, torch; from engine.backends.aot import load_in_place; "
            f"fn = load_in_place({str(h.folder / 'aot' / 'model.so')!r}, torch.device('cpu')); "
            f"t, mg = fn(torch.from_numpy(np.load({str(tmp_path / 'x.npy')!r}))); "
            "print(json.dumps([t.tolist(), 'torchao' in sys.modules]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    answers, imported = json.loads(r.stdout.strip().splitlines()[-1])
    assert answers == top1.tolist() and imported is False


def test_torchao_is_imported_lazily_where_a_quantized_graph_is_built():
    """torchao is no import of any module's top level (the run, the API and the other precisions
    never load it); the int8 module imports it inside its functions."""
    import ast

    users = set()
    for p in sorted((REPO / "engine").rglob("*.py")) + sorted((REPO / "evaluator").rglob("*.py")):
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "torchao" or n.startswith("torchao.") for n in names):
                users.add(p.relative_to(REPO).as_posix())
                assert node not in tree.body, f"{p.relative_to(REPO)} imports torchao at its top level"
    assert "engine/core/int8.py" in users


def test_an_int8_compile_without_torchao_fails_in_one_line(monkeypatch, no_torchao):
    """An import that fails after all (torchao found but broken) fails the compile with its reason."""
    from engine.core import int8

    with pytest.raises(ImportError, match="torchao"):
        int8.export_int8(torch.nn.Identity(), tiny_spec(precision="int8"), "cpu", False, np.zeros((1, 112, 112, 3),
                                                                                                  np.uint8))
