"""Folders a command writes: never one that is not its own, one build at a time, nothing left behind.

engine.io.folder_refusal is the one rule (an empty path, `.`, the current directory, the project or a
folder above either, a file, a folder holding an input, a non-empty folder this kit did not make);
each refused case must leave the path byte-identical. engine.build holds OUT's lock until its commit,
its work folder is removed on every exit (and by the next build after a kill), and its children die
with it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY_INPUT, TINY_KWARGS, TINY_MODEL

from engine.io import make_owned_temp, take_lock
from engine.tuning import command

NULL_BUILD = ["--model", TINY_MODEL, "--backend", "null", "--precision", "fp32", "--batch-size", "1",
              "--input-size", str(TINY_INPUT), "--model-kwargs", json.dumps(TINY_KWARGS)]


def snapshot(root: Path) -> dict:
    """Every name under `root` (root included) with its kind, mode and bytes: what 'untouched' means."""
    out = {}
    paths = [root, *sorted(root.rglob("*"))] if root.is_dir() else [root]
    for p in paths:
        st = p.lstat()
        body = p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p) if p.is_symlink() else None
        out[str(p.relative_to(root.parent))] = (st.st_mode, body)
    return out


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """tmp_path/home/work as the current directory, with a file and a foreign folder beside it."""
    work = tmp_path / "home" / "work"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("a user's file\n")
    (work / "photos").mkdir()
    (work / "photos" / "a.jpg").write_bytes(b"\xff\xd8 not ours")
    monkeypatch.chdir(work)
    return work


def _refused_build(argv: list[str], capsys) -> str:
    rc = command.main(NULL_BUILD + argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("engine.build: error:"), (rc, err)
    return err[0]


@pytest.mark.parametrize("out, why", [
    ("", "empty or '.'"), (".", "empty or '.'"), ("..", "holds the current directory"),
    ("notes.txt", "is a file"), ("photos", "holds files this kit did not make"),
    ("photos-link", "holds files this kit did not make"),
])
def test_the_build_refuses_a_folder_that_is_not_its_own_and_changes_nothing(workdir, capsys, out, why):
    (workdir / "photos-link").symlink_to(workdir / "photos")
    before = snapshot(workdir.parent)
    assert why in _refused_build(["--out", out], capsys)
    assert snapshot(workdir.parent) == before        # no lock, no work folder, no file touched


def test_the_build_refuses_the_project_and_a_folder_above_it(workdir, capsys):
    above = set(os.listdir(REPO.parent))
    for out in (str(REPO), str(REPO.parent)):
        assert "this project" in _refused_build(["--out", out], capsys)
    assert set(os.listdir(REPO.parent)) == above and (REPO / ".git").exists()


def test_the_build_refuses_an_artifact_holding_its_checkpoint(workdir, capsys, tiny_checkpoint):
    art = workdir / "art"
    assert command.main(NULL_BUILD + ["--out", str(art)]) == 0
    (art / "model.safetensors").write_bytes(tiny_checkpoint.read_bytes())
    capsys.readouterr()
    before = snapshot(art)
    line = _refused_build(["--out", str(art), "--checkpoint", str(art / "model.safetensors")], capsys)
    assert "holds an input" in line and snapshot(art) == before


def test_an_artifact_of_the_kit_and_an_empty_folder_are_replaced(workdir, capsys):
    (workdir / "empty").mkdir()
    for out in ("empty", "new/art", "empty"):        # empty, absent (parent made), then an artifact of the kit
        assert command.main(NULL_BUILD + ["--out", out]) == 0
        assert json.loads((workdir / out / "manifest.json").read_text())["backend"] == "null"
    leftovers = [p.name for p in workdir.iterdir() if ".build-" in p.name]
    assert leftovers == []


def test_a_second_build_of_one_folder_stops_while_the_first_holds_its_lock(workdir, capsys):
    assert command.main(NULL_BUILD + ["--out", "art"]) == 0
    before = snapshot(workdir / "art")
    fd = take_lock(workdir / ".art.lock")             # a build of art in progress
    try:
        line = _refused_build(["--out", "art"], capsys)
    finally:
        os.close(fd)
    assert f"another build of {workdir / 'art'} is running (pid {os.getpid()}" in line
    assert snapshot(workdir / "art") == before
    assert command.main(NULL_BUILD + ["--out", "art"]) == 0   # the lock died with its holder's fd


def test_a_killed_builds_work_folder_is_removed_by_the_next_build_and_a_live_ones_is_kept(workdir, capsys):
    # a work folder whose maker is gone (its owner lock was released with its fd, as at a kill)...
    dead, fd = make_owned_temp(workdir, ".other.build-")
    (dead / "artifact").mkdir()
    (dead / "artifact" / "model.pt2").write_bytes(b"x" * 1000)
    os.close(fd)
    # ...and one whose maker is alive (this process holds its lock)
    live, live_fd = make_owned_temp(workdir, ".art2.build-")
    try:
        assert command.main(NULL_BUILD + ["--out", "art"]) == 0
        err = capsys.readouterr().err
        assert not dead.exists() and f"removed {dead}" in err
        assert live.exists()
    finally:
        os.close(live_fd)


def test_the_demo_refuses_an_empty_artifact_path_and_a_foreign_folder(workdir, capsys):
    from evaluator.contest import demo

    before = snapshot(workdir.parent)
    for argv, why in ((["prepare", "--artifact", ""], "empty or '.'"),
                      (["prepare", "--out", ""], "empty or '.'"),
                      (["prepare", "--out", "photos"], "holds files this kit did not make"),
                      (["prepare", "--artifact", "photos"], "holds files this kit did not make")):
        assert demo.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], (argv, err)
    assert snapshot(workdir.parent) == before


@pytest.mark.parametrize("entry", ["cohort", "cir_corpus", "cir_build"])
def test_the_generators_and_the_index_build_refuse_a_foreign_folder(workdir, capsys, entry):
    from evaluator.cir import build as cir_build
    from evaluator.synthetic import cir_corpus, cohort

    corpus = workdir / "corpus"
    corpus.mkdir()
    (corpus / "records.jsonl").write_text('{"image_id": "a", "path": "a.jpg"}\n')
    main, args = {"cohort": (cohort.main, ["--count", "2"]), "cir_corpus": (cir_corpus.main, []),
                  "cir_build": (cir_build.main, ["--corpus", str(corpus)])}[entry]
    flag = "--index-dir" if entry == "cir_build" else "--out"
    before = snapshot(workdir.parent)
    for target, why in (("photos", "holds files this kit did not make"), ("notes.txt", "is a file"),
                        (".", "empty or '.'")):
        assert main([*args, flag, target]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], (entry, target, err)
    assert snapshot(workdir.parent) == before


# ------------------------------------------------------------------ children die with their parent
def _build_sh_env(ckpt: Path, artifact: Path, precision: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINE_") and k != "FORCE"}
    env.update({"ENGINE_MODEL": TINY_MODEL, "ENGINE_CHECKPOINT": str(ckpt), "ENGINE_ARTIFACT": str(artifact),
                "ENGINE_INPUT_SIZE": str(TINY_INPUT), "ENGINE_CROP_MODE": "squash", "ENGINE_CROP_PCT": "1.0",
                "ENGINE_MODEL_KWARGS": json.dumps(TINY_KWARGS), "ENGINE_BATCH_SIZE": "4",
                "ENGINE_BACKEND": "eager", "ENGINE_PRECISION": precision, "ENGINE_DEVICE": "cpu"})
    return env


def _builds_of(artifact: Path) -> list[int]:
    """pids of the engine.build processes writing `artifact`."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"engine.build" in argv and any(a.endswith(str(artifact).encode()) for a in argv):
                pids.append(int(d.name))
    return pids


def _wait(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.abi
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_build_sh_leaves_no_build_running_and_nothing_behind(tmp_path, tiny_checkpoint, sig):
    """SIGKILL: the kernel SIGTERMs the orphaned engine.build (PR_SET_PDEATHSIG), which removes its
    work folder; SIGTERM: build.sh stops its build and says so in one line. A later build is never
    replaced by a leftover one."""
    art = tmp_path / "out" / "art"
    art.parent.mkdir()
    err = tmp_path / "stderr"
    with open(err, "wb") as f:   # a measured build: minutes of work, stopped within seconds
        proc = subprocess.Popen(["sh", str(REPO / "build.sh")], env=_build_sh_env(tiny_checkpoint, art, "auto"),
                                stdout=subprocess.DEVNULL, stderr=f)
    try:
        child = _wait(lambda: _builds_of(art), 120, "engine.build to start")[0]
        _wait(lambda: [p for p in art.parent.iterdir() if ".build-" in p.name], 120, "the build's work folder")
        proc.send_signal(sig)
        rc = proc.wait(30)
        _wait(lambda: not _builds_of(art), 30, f"engine.build (pid {child}) to exit after its parent")
    finally:
        proc.kill()
        proc.wait()
    lines = err.read_text().splitlines()
    if sig == signal.SIGTERM:
        assert rc == 128 + signal.SIGTERM, lines[-5:]
        assert "stopped by signal 15 (SIGTERM)" in lines[-1] and "Traceback" not in err.read_text()
    assert not [p for p in art.parent.iterdir() if ".build-" in p.name]
    if sig == signal.SIGTERM:
        return
    # a later build completes and stays: nothing is left to replace it
    r = subprocess.run(["sh", str(REPO / "build.sh")], env=_build_sh_env(tiny_checkpoint, art, "fp32"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = (art / "manifest.json").read_bytes()
    time.sleep(2.0)
    assert (art / "manifest.json").read_bytes() == manifest and not _builds_of(art)


@pytest.mark.abi
def test_a_terminated_build_keeps_the_artifact_it_was_replacing(tmp_path, tiny_checkpoint):
    art = tmp_path / "art"
    base = [sys.executable, "-m", "engine.build", "--model", TINY_MODEL, "--checkpoint", str(tiny_checkpoint),
            "--input-size", str(TINY_INPUT), "--model-kwargs", json.dumps(TINY_KWARGS), "--crop-mode", "squash",
            "--crop-pct", "1.0", "--backend", "eager", "--batch-size", "4", "--out", str(art)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([*base, "--precision", "fp32"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    before = snapshot(art)
    proc = subprocess.Popen([*base, "--precision", "auto"], env=env, stdout=subprocess.DEVNULL,   # minutes of work
                            stderr=subprocess.PIPE, text=True)
    _wait(lambda: [p for p in tmp_path.iterdir() if ".build-" in p.name], 120, "the build's work folder")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == f"engine.build: stopped by signal 15 (SIGTERM): {art} is as it was"
    assert "Traceback" not in stderr
    assert snapshot(art) == before and not [p for p in tmp_path.iterdir() if ".build-" in p.name]
