"""scripts/rehearse: passes a correct run as nobody, offline; fails writes outside, wrong outputs, JIT."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from evaluator.rehearsal import rehearse

pytestmark = pytest.mark.abi   # scripts/rehearse as whole processes

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("unshare"),
    reason="the rehearsal needs root, setpriv and unshare")


@pytest.fixture(scope="module")
def demo(tiny_checkpoint, tmp_path_factory) -> Path:
    """`python -m evaluator.demo prepare` output (24 generated images, eager artifact), reusing the session's checkpoint."""
    from evaluator.contest.demo import prepare

    out = tmp_path_factory.mktemp("demo")
    for suffix in (".safetensors", ".json"):  # prepare reuses a checkpoint whose recipe has the same seed
        shutil.copy(tiny_checkpoint.with_suffix(suffix), out / f"tiny_eva02{suffix}")
    prepare(out, count=24, seed=0, backend="eager", batch_size=8)
    return out


@pytest.fixture
def shared_dir():
    """A folder the unprivileged user can read (pytest's tmp_path is under a 0700 folder)."""
    d = Path(tempfile.mkdtemp(prefix="rehearse-test-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _good_output(demo: Path, dest: Path) -> Path:
    """The reference answers as a valid output (the unreadable row's -1 becomes 0)."""
    ref = np.fromfile(demo / "reference.i32", "<i4")
    np.where(ref < 0, 0, ref).astype("<i4").tofile(dest)
    os.chmod(dest, 0o644)
    return dest


def _rehearse(*args: str) -> tuple[int, dict, str]:
    r = subprocess.run([str(REPO / "scripts" / "rehearse"), *args], capture_output=True, text=True, timeout=900)
    summary = json.loads(r.stdout) if r.stdout.strip() else {}
    return r.returncode, summary, r.stderr


@needs_root
def test_eager_run_passes_as_the_image_user_offline(demo):
    rc, s, err = _rehearse("--prepared", str(demo))
    assert rc == 0, err[-3000:]
    assert s["verdict"] == "PASS" and s["failures"] == []
    assert s["user"] == "10001:10001" and s["network"].startswith("isolated")
    assert s["rows"] == 24 and s["agreement_rate"] >= 0.99
    assert s["writes_outside"] == [] and s["compiled"] == []
    assert s["memory_limit_bytes"] == 16 << 30
    assert "/tmp" in s["writable_places"]
    assert set(s["output_files"]) == {"predictions.i32", "report.json"}


@needs_root
def test_default_aot_backend_passes_without_compiling(demo, aot_artifact):
    rc, s, err = _rehearse("--prepared", str(demo), "--artifact", str(aot_artifact))
    assert rc == 0, err[-3000:]
    assert s["verdict"] == "PASS" and s["compiled"] == []
    assert s["report"]["total"] > 0  # the run's own timing report came back from the output folder


@needs_root
def test_fails_when_the_run_writes_outside(demo, shared_dir):
    good = _good_output(demo, shared_dir / "good.i32")
    probes = [Path("/tmp") / f"rehearse-probe-{uuid.uuid4().hex}", Path("/dev/shm") / f"rehearse-probe-{uuid.uuid4().hex}"]
    probes = [p for p in probes if os.access(p.parent, os.W_OK)]
    cmd = " ".join(f"touch {p};" for p in probes) + f' cat {good} > "$3"'
    try:
        rc, s, err = _rehearse("--prepared", str(demo), "--run-cmd", cmd)
        assert rc == 1, err[-3000:]
        assert s["verdict"] == "FAIL"
        for p in probes:
            assert f"created {p}" in s["writes_outside"], s["writes_outside"]
        assert "wrote outside TMPDIR" in err
        assert s["agreement_rate"] == 1.0  # the output itself was fine: the write alone fails the run
    finally:
        for p in probes:
            p.unlink(missing_ok=True)


@needs_root
def test_env_hook_and_user_cannot_write_home_or_code(demo, shared_dir):
    """REHEARSE_RUN_CMD injects a command; HOME, the code copy and the artifact copy are not writable."""
    good = _good_output(demo, shared_dir / "good.i32")
    cmd = ('for p in "$HOME" "$REHEARSE_REPO" "$ENGINE_ARTIFACT"; do touch "$p/x" 2>/dev/null && exit 3; done; '
           f'cat {good} > "$3"')
    env = {**os.environ, "REHEARSE_RUN_CMD": cmd}
    r = subprocess.run([str(REPO / "scripts" / "rehearse"), "--prepared", str(demo)], env=env,
                       capture_output=True, text=True, timeout=900)
    s = json.loads(r.stdout)
    assert r.returncode == 0 and s["verdict"] == "PASS", r.stderr[-3000:]


@needs_root
@pytest.mark.parametrize("case, cmd, reason", [
    ("short", 'head -c 8 /dev/zero > "$3"', "expected 4 x 24 rows"),
    ("range", 'head -c 96 /dev/zero | tr "\\000" "\\377" > "$3"', "outside [0, 999]"),
    ("wrong", 'head -c 96 /dev/zero > "$3"', "agreement"),
    ("missing", "true", "no output file"),
], ids=["short", "range", "wrong", "missing"])
def test_fails_on_a_wrong_output(demo, case, cmd, reason):
    rc, s, err = _rehearse("--prepared", str(demo), "--run-cmd", cmd)
    assert rc == 1 and s["verdict"] == "FAIL", (case, err[-2000:])
    assert any(reason in f for f in s["failures"]), (case, s["failures"])


@needs_root
def test_fails_on_compilation_at_run_time(demo, shared_dir):
    good = _good_output(demo, shared_dir / "good.i32")
    cmd = ('mkdir -p "$TMPDIR/inductor/ab" && echo "int k;" > "$TMPDIR/inductor/ab/k.cpp" && '
           f'echo x > "$TMPDIR/kernel.so" && cat {good} > "$3"')
    rc, s, err = _rehearse("--prepared", str(demo), "--run-cmd", cmd)
    assert rc == 1, err[-2000:]
    assert any("compile cache" in c for c in s["compiled"]) and any("kernel.so" in c for c in s["compiled"])
    assert s["writes_outside"] == []


@needs_root
def test_interpreter_under_a_private_folder_is_made_reachable(demo, shared_dir):
    """Python under a 0700 folder (pyenv in /root) is bound into the user's mount namespace."""
    good = _good_output(demo, shared_dir / "good.i32")
    hidden = shared_dir / "hidden"
    hidden.mkdir(mode=0o700)
    prefix = Path(sys.base_prefix)
    if sys.prefix != sys.base_prefix:
        pytest.skip("a virtual environment: its prefix cannot be moved under a bind mount")
    py = hidden / "py" / Path(sys.executable).relative_to(prefix)
    script = (f"set -e; mkdir -p {hidden}/py; mount --bind {prefix} {hidden}/py; "
              f"exec {py} -m evaluator.rehearse --prepared {demo} --run-cmd 'cat {good} > \"$3\"'")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], cwd=REPO,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    s = json.loads(r.stdout)
    assert r.returncode == 0 and s["verdict"] == "PASS", r.stderr[-3000:]
    assert any(str(hidden) in n for n in s["notes"]), s["notes"]


def test_an_in_place_aot_artifact_allows_no_compiled_file_in_tmpdir(aot_artifact, tmp_path):
    """The aot backend's graph is loaded where it lies: even a copy of its own .so in TMPDIR is flagged."""
    entries = rehearse.aoti_entries(aot_artifact)
    assert entries == {}
    (tmp_path / "aotinductor_Ab12Cd").mkdir()
    shutil.copy(aot_artifact / "aot" / "model.so", tmp_path / "aotinductor_Ab12Cd" / "model.so")
    bad, extracted = rehearse.compiled_at_run_time(tmp_path, entries)
    assert extracted == [] and any("model.so" in b for b in bad)


@needs_root
def test_rehearses_exactly_the_given_artifact_on_the_given_cohort(demo):
    """--artifact A --cohort C: nothing prepared or built; the reference comes from A's own spec and checkpoint."""
    rc, s, err = _rehearse("--artifact", str(demo / "artifact"), "--cohort", str(demo / "cohort"))
    assert rc == 0, err[-3000:]
    assert s["verdict"] == "PASS" and s["rows"] == 24 and s["agreement_rate"] >= 0.99
    assert "preparing" not in err and "building" not in err
    assert "computing the reference with the artifact's spec (" in err and "squash" in err


def test_artifact_options_are_checked_before_anything(tmp_path, capsys):
    for argv, words in [(["--cohort", str(tmp_path)], "--cohort goes with --artifact"),
                        (["--artifact", str(tmp_path), "--reference", "r.i32", "--checkpoint", "c"],
                         "--checkpoint is for the reference")]:
        with pytest.raises(SystemExit) as info:
            rehearse.main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert rehearse.main(["--artifact", str(tmp_path)]) == 2          # no manifest.json: not an artifact
    assert "not an artifact" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_without_root_it_rehearses_what_it_can_and_says_what_it_cannot(demo, monkeypatch, capsys, shared_dir):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    good = _good_output(demo, shared_dir / "good.i32")
    rc = rehearse.main(["--prepared", str(demo), "--run-cmd", f'cat {good} > "$3"'])
    out, err = capsys.readouterr()
    s = json.loads(out)
    assert rc == 0 and s["verdict"] == "PASS" and s["privileged"] is False, err[-2000:]
    assert "not checked without root: the switch to an unprivileged user" in err
    assert s["writable_places"] is None and any("not checked without root" in n for n in s["notes"])
    # what it still checks: a write into the read-only code copy fails the run
    rc = rehearse.main(["--prepared", str(demo), "--run-cmd", f'touch "$REHEARSE_REPO/x"; cat {good} > "$3"'])
    s = json.loads(capsys.readouterr().out)
    assert rc == 1 and any("x" in w and "created" in w for w in s["writes_outside"]), s["writes_outside"]


def test_parse_size():
    assert rehearse.parse_size("16G") == 16 << 30 and rehearse.parse_size("512M") == 512 << 20
    assert rehearse.parse_size("none") is None
