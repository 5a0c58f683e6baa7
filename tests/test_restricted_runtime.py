"""The ABI under the scored environment's restrictions: non-root, offline, HOME unwritable,
code and artifact read-only; every cache must go to TMPDIR or nowhere."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

NOBODY = 65534
SCORED_UID = 10001   # the scored environment's user: no name, no capabilities
pytestmark = [pytest.mark.abi,   # scripts/run as whole processes, as another user
              pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("setpriv") and shutil.which("unshare")),
                                 reason="needs root, setpriv and unshare to drop privileges and the network")]


def _snapshot(root: Path) -> dict[str, tuple[int, float]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime) for p in root.rglob("*") if p.is_file()}


def test_run_as_nobody_offline_read_only(small_cohort, aot_artifact):
    from evaluator.rehearsal.sandbox import interpreter_mounts, user_command

    base = Path(tempfile.mkdtemp(prefix="restricted-"))
    try:
        os.chmod(base, 0o755)
        code, art, data = base / "code", base / "artifact", base / "data"
        shutil.copytree(REPO, code, ignore=shutil.ignore_patterns(".git", "__pycache__", "artifacts", "demo",
                                                                  "*.egg-info", ".pytest_cache"))
        shutil.copytree(aot_artifact, art)
        shutil.copytree(small_cohort, data)
        for p in (code, art, data):  # root-owned, world-readable, not writable by the run
            subprocess.run(["chmod", "-R", "u=rwX,go=rX", str(p)], check=True)
        outdir, tmp = base / "out", base / "tmp"
        for d in (outdir, tmp):
            d.mkdir()
            os.chown(d, NOBODY, NOBODY)
        before = {p: _snapshot(p) for p in (code, art, data)}
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", "TMPDIR": str(tmp),
               "ENGINE_ARTIFACT": str(art), "PYTHON": sys.executable, "LANG": "C.UTF-8"}
        # no network (own namespace), dropped to nobody with no capabilities; an interpreter
        # under a private folder (pyenv in /root) is bound back inside a private mount namespace
        (base / "stage").mkdir()
        cmd = user_command([str(code / "scripts" / "run"), str(data / "manifest.tsv"), str(data),
                            str(outdir / "p.i32")], env, NOBODY, NOBODY, None, 256, True,
                           interpreter_mounts(NOBODY, NOBODY), base / "stage")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        pred = np.fromfile(outdir / "p.i32", "<i4")
        assert len(pred) == 40 and pred.min() >= 0 and pred.max() <= 999
        for p, snap in before.items():
            assert _snapshot(p) == snap, f"the run wrote into {p}"
        assert sorted(x.name for x in outdir.iterdir()) == ["p.i32"]
        # nothing was compiled at run time: no inductor / triton cache entries
        for cache in ("inductor", "triton"):
            d = tmp / cache
            assert not d.exists() or not any(d.rglob("*.so")), f"runtime compilation under {d}"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_root_built_artifact_loads_as_another_user_with_its_modes_as_built(small_cohort, tiny_checkpoint):
    """An artifact built by root under umask 077, copied with its modes as they are, loads for an
    unprivileged user under the scored address-space bound: every file the build wrote is readable."""
    from conftest import tiny_spec

    from engine.tuning import build
    from evaluator.rehearsal.sandbox import interpreter_mounts, user_command

    base = Path(tempfile.mkdtemp(prefix="restricted-"))
    try:
        os.chmod(base, 0o755)
        art, data, outdir = base / "artifact", base / "data", base / "out"
        old = os.umask(0o077)
        try:
            build(tiny_spec(), tiny_checkpoint, art, backend="eager", device="cpu")
        finally:
            os.umask(old)
        shutil.copytree(small_cohort, data)
        subprocess.run(["chmod", "-R", "u=rwX,go=rX", str(data)], check=True)
        outdir.mkdir()
        os.chown(outdir, SCORED_UID, SCORED_UID)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", "TMPDIR": str(outdir),
               "ENGINE_ARTIFACT": str(art), "PYTHON": sys.executable, "LANG": "C.UTF-8", "ENGINE_THREADS": "2"}
        (base / "stage").mkdir()
        cmd = user_command([str(REPO / "scripts" / "run"), str(data / "manifest.tsv"), str(data),
                            str(outdir / "p.i32")], env, SCORED_UID, SCORED_UID, 8 << 30, 256, True,
                           interpreter_mounts(SCORED_UID, SCORED_UID), base / "stage")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert len(np.fromfile(outdir / "p.i32", "<i4")) == 40
    finally:
        shutil.rmtree(base, ignore_errors=True)
