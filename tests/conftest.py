"""Shared fixtures: generated cohorts, the tiny EVA-02 checkpoint and built artifacts.

Everything is made here from generated images (no downloads, no real data) once per
session. GPU tests carry the `gpu` marker and skip cleanly without CUDA; the `emulated` ones (the
ARM64 image rehearsed under qemu) run only when selected with `-m emulated`.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# OpenMP threads that busy-wait starve everything else on a 2-core machine (set before torch loads)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from evaluator.synthetic.cohort import TINY_INPUT, TINY_KWARGS, TINY_MODEL  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_settings(monkeypatch):
    """engine.settings reads each variable once: forget them around every test and after
    every monkeypatch.setenv / delenv, so a test sees the environment it sets."""
    from engine import settings

    settings.reload()
    for name in ("setenv", "delenv"):
        orig = getattr(monkeypatch, name)

        def changed(*args, _orig=orig, **kwargs):
            _orig(*args, **kwargs)
            settings.reload()

        setattr(monkeypatch, name, changed)
    yield
    settings.reload()


def pytest_benchmark_update_machine_info(config, machine_info):
    """What a CPU figure holds for, in every saved benchmark JSON: the CPU capability torch
    dispatches to, the torch version and the kit's thread budget."""
    import torch

    from engine.threads import budget

    b = budget("cpu")
    machine_info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    machine_info["torch"] = torch.__version__
    machine_info["thread_budget"] = {"total": b.total, "decoder": b.decoder, "intra_op": b.intra_op}
    machine_info["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "")


def pytest_collection_modifyitems(config, items):
    import torch

    # the emulated ARM64 rehearsal takes an hour and root: only when asked for by name (-m emulated)
    if "emulated" not in (config.getoption("markexpr") or ""):
        for item in items:
            if "emulated" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="emulated ARM64 rehearsal: run with -m emulated (root, ~1 h)"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def tiny_spec(crop_mode: str = "squash", batch_size: int = 16, precision: str = "fp32"):
    from engine.core.spec import resolve_spec

    return resolve_spec(TINY_MODEL, input_size=TINY_INPUT, crop_pct=1.0, crop_mode=crop_mode,
                        batch_size=batch_size, precision=precision, model_kwargs=TINY_KWARGS)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny EVA-02 whose head was fit on generated renders (~20 s on two cores)."""
    from evaluator.synthetic.cohort import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("ckpt") / "tiny_eva02.safetensors"
    make_tiny_checkpoint(path, seed=0)
    return path


@pytest.fixture(scope="session")
def cohort(tmp_path_factory) -> Path:
    """400 generated images (4 broken) with a manifest: enough rows for a 99.5 % gate to mean something."""
    from evaluator.synthetic.cohort import make_cohort

    root = tmp_path_factory.mktemp("cohort")
    make_cohort(root, 400, seed=0, broken=4)
    return root


@pytest.fixture(scope="session")
def small_cohort(tmp_path_factory) -> Path:
    """40 generated images (3 broken: empty, truncated, text) for fast ABI tests."""
    from evaluator.synthetic.cohort import make_cohort

    root = tmp_path_factory.mktemp("small")
    make_cohort(root, 40, seed=1, broken=3)
    return root


def _build(tmp_path_factory, ckpt: Path, backend: str, crop_mode: str, batch_size: int = 16) -> Path:
    from engine.tuning import build

    out = tmp_path_factory.mktemp(f"art_{backend}_{crop_mode}") / "artifact"
    build(tiny_spec(crop_mode, batch_size), ckpt, out, backend=backend, device="cpu")
    return out


@pytest.fixture(scope="session")
def eager_artifact(tmp_path_factory, tiny_checkpoint) -> Path:
    return _build(tmp_path_factory, tiny_checkpoint, "eager", "squash")


@pytest.fixture(scope="session")
def aot_artifact(tmp_path_factory, tiny_checkpoint) -> Path:
    """AOTInductor CPU package, squash crop (~40 s to compile)."""
    return _build(tmp_path_factory, tiny_checkpoint, "aot", "squash")


@pytest.fixture(scope="session")
def aot_artifact_center(tmp_path_factory, tiny_checkpoint) -> Path:
    return _build(tmp_path_factory, tiny_checkpoint, "aot", "center")


@pytest.fixture(scope="session")
def plain_run(tmp_path_factory, small_cohort, eager_artifact):
    """scripts/run over the small cohort with the eager artifact and `--report`, once for the session:
    (CompletedProcess, OUTPUT, report). The tests that compare another run's answers against the
    plain layout's read these (do not write to them)."""
    d = tmp_path_factory.mktemp("plain_run")
    out, report = d / "pred.i32", d / "timing.json"
    r = run_abi(small_cohort / "manifest.tsv", small_cohort, out, eager_artifact, "--report", str(report))
    return r, out, report


def run_abi(manifest: Path, root: Path, output: Path, artifact: Path, *extra: str, env: dict | None = None,
            timeout: float = 300):
    """scripts/run as a whole process; returns the CompletedProcess."""
    import subprocess

    e = {**os.environ, "ENGINE_ARTIFACT": str(artifact), **(env or {})}
    return subprocess.run([str(REPO / "scripts" / "run"), str(manifest), str(root), str(output), *extra],
                          env=e, capture_output=True, text=True, timeout=timeout)


def readme_python_block(n: int) -> str:
    """The n-th ```python block of README.md, as the README shows it (its examples run in tests)."""
    blocks = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.M | re.S)
    return blocks[n]
