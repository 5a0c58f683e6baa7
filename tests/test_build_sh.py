"""build.sh: offline, builds from a read-only checkpoint, checks the artifact, reuses it, fails loudly."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, TINY_INPUT, TINY_KWARGS, TINY_MODEL

pytestmark = pytest.mark.abi   # ./build.sh as whole processes

BUILD = REPO / "build.sh"
DOWNLOADS = re.compile(r"\bcurl\b|\bwget\b|pip3?\s+install|python -m pip|git\s+clone|hf_hub_download|"
                       r"snapshot_download|huggingface-cli|hf download|torch\.hub|from_pretrained|"
                       r"pretrained=True|urlopen|urlretrieve|requests\.get", re.IGNORECASE)


def _env(ckpt: Path, artifact: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINE_") and k != "FORCE"}
    env.update({"ENGINE_MODEL": TINY_MODEL, "ENGINE_CHECKPOINT": str(ckpt), "ENGINE_ARTIFACT": str(artifact),
                "ENGINE_INPUT_SIZE": str(TINY_INPUT), "ENGINE_CROP_MODE": "squash", "ENGINE_CROP_PCT": "1.0",
                "ENGINE_MODEL_KWARGS": json.dumps(TINY_KWARGS), "ENGINE_BATCH_SIZE": "4",
                "ENGINE_BACKEND": "eager", "ENGINE_DEVICE": "auto", **extra})
    return env


def _build(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(BUILD)], env=env, capture_output=True, text=True, timeout=600, cwd="/")


@pytest.fixture(scope="module")
def read_only_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint in a folder nobody may write, as the contest mounts it."""
    d = tmp_path_factory.mktemp("ro_ckpt")
    ck = d / "model.safetensors"
    shutil.copy(tiny_checkpoint, ck)
    os.chmod(ck, 0o444)
    os.chmod(d, 0o555)
    return ck


SPEC_KNOBS = ("ENGINE_MODEL", "ENGINE_INPUT_SIZE", "ENGINE_CROP_MODE", "ENGINE_CROP_PCT", "ENGINE_MODEL_KWARGS")


@pytest.fixture(scope="module")
def first_build(read_only_checkpoint, tmp_path_factory):
    """The documented small build: no spec knob (the kit's checkpoint records its own spec), no
    precision (auto: measured here, among the CPU's native precisions)."""
    art = tmp_path_factory.mktemp("build_sh") / "art"
    env = {k: v for k, v in _env(read_only_checkpoint, art).items() if k not in SPEC_KNOBS}
    return art, env, _build(env)


def test_no_download_in_build_sh():
    text = BUILD.read_text()
    hits = [ln for ln in text.splitlines() if DOWNLOADS.search(ln)]
    assert not hits, f"build.sh must not download anything: {hits}"
    assert text.startswith("#!/bin/sh\n")
    assert os.access(BUILD, os.X_OK), "build.sh should be executable"
    assert subprocess.run(["sh", "-n", str(BUILD)]).returncode == 0


def test_builds_and_checks_the_artifact(first_build):
    art, _, r = first_build
    assert r.returncode == 0, r.stderr[-3000:]
    assert "building" in r.stderr and "OK:" in r.stderr
    assert f"the checkpoint records its spec: ENGINE_MODEL={TINY_MODEL}" in r.stderr
    m = json.loads((art / "manifest.json").read_text())
    assert (m["backend"], m["device"], m["batch_size"]) == ("eager", "cpu", 4)
    search = m["build"]["search"]                      # precision auto: measured, verified, recorded
    assert search["chosen"] == f"eager/{m['precision']}/b4" and search["verify"][-1]["ok"]
    assert "autotune: chose eager/" in r.stderr and "fp32" in [c["precision"] for c in search["candidates"]]
    assert m["spec"]["model"] == TINY_MODEL and m["spec"]["crop_mode"] == "squash"
    v = m["versions"]                                  # the stack build.sh says it builds with is the recorded one
    assert (f"build.sh: stack: torch {v['torch']} (CUDA {v['torch_cuda']}) torchvision {v['torchvision']} "
            f"timm {v['timm']} DALI {v['nvidia-dali-cuda130']}") in r.stderr
    check = [json.loads(ln) for ln in r.stderr.splitlines() if ln.startswith('{"ok"')]
    assert check and check[0]["ok"] and 0 <= check[0]["top1"] <= 999
    # one deadline (the preset's 1,500 s): engine.build gets what is left after the check's reserve
    plan = re.search(r"build\.sh: deadline 1500 s: (\d+) s spent preparing, engine\.build (\d+) s, 90 s kept", r.stderr)
    assert plan and int(plan[1]) + int(plan[2]) == 1500 - 90
    assert abs(search["clock"]["deadline_s"] - int(plan[2])) <= 1 and search["clock"]["left_s"] > 0
    assert set(search["clock"]["actual_s"]) >= {"checkpoint", "calibration", "search", "verify"}
    assert re.search(r"build\.sh: spent \d+ s of the 1500 s deadline", r.stderr)


def test_a_deadline_that_leaves_no_time_for_the_build_is_a_usage_error(tmp_path, read_only_checkpoint):
    r = _build(_env(read_only_checkpoint, tmp_path / "art", ENGINE_BUILD_DEADLINE_S="60", FORCE="1"))
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("build.sh: error: ENGINE_BUILD_DEADLINE_S: 60 s leaves no time for the build")
    assert not (tmp_path / "art").exists()


def test_second_run_reuses_a_corrupt_artifact_or_force_rebuilds(first_build, tmp_path):
    built, env, r = first_build
    assert r.returncode == 0, r.stderr[-3000:]
    art = tmp_path / "art"                   # a copy: the module's other tests keep the measured build
    shutil.copytree(built, art)
    env = {**env, "ENGINE_ARTIFACT": str(art)}
    stamp = (art / "manifest.json").stat().st_mtime_ns
    r2 = _build(env)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "reusing artifact" in r2.stderr and "building" not in r2.stderr
    assert (art / "manifest.json").stat().st_mtime_ns == stamp
    # the rebuilds below name the precision the artifact records: the same artifact (reused as is,
    # checked here), built without measuring the precisions again (~15 s a build instead of ~40)
    env = {**env, "ENGINE_PRECISION": json.loads((art / "manifest.json").read_text())["precision"]}
    r2b = _build(env)
    assert r2b.returncode == 0 and "reusing artifact" in r2b.stderr, r2b.stderr[-3000:]
    with open(art / "weights.safetensors", "r+b") as f:  # flip bits inside the weights: same size
        f.seek(-64, os.SEEK_END)
        tail = f.read()
        f.seek(-64, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))
    r3 = _build(env)
    assert r3.returncode == 0, r3.stderr[-3000:]
    assert "not intact" in r3.stderr and "building" in r3.stderr
    stamp3 = (art / "manifest.json").stat().st_mtime_ns
    assert stamp3 != stamp
    r4 = _build({**env, "FORCE": "1"})  # current again, but FORCE=1 rebuilds all the same
    assert r4.returncode == 0, r4.stderr[-3000:]
    assert "building" in r4.stderr and "reusing" not in r4.stderr
    assert (art / "manifest.json").stat().st_mtime_ns != stamp3


def test_flags_that_change_the_artifact_make_it_stale(first_build, read_only_checkpoint):
    from evaluator.contest.selfcheck import stale_reasons

    art, _, r = first_build
    assert r.returncode == 0, r.stderr[-3000:]
    base = ["--model", TINY_MODEL, "--checkpoint", str(read_only_checkpoint), "--out", str(art),
            "--input-size", str(TINY_INPUT), "--crop-mode", "squash", "--crop-pct", "1.0",
            "--model-kwargs", json.dumps(TINY_KWARGS), "--batch-size", "4", "--backend", "eager",
            "--precision", "auto"]
    assert stale_reasons(base) == []
    other = "bf16" if json.loads((art / "manifest.json").read_text())["precision"] == "fp32" else "fp32"
    assert any("spec differs" in s and "precision" in s for s in stale_reasons(base + ["--precision", other]))
    assert any("backend" in s for s in stale_reasons(base + ["--backend", "aot"]))
    assert any("spec differs" in s for s in stale_reasons(base + ["--batch-size", "8"]))


def test_missing_checkpoint_is_a_usage_error(tmp_path):
    r = _build(_env(tmp_path / "absent.safetensors", tmp_path / "art"))
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("build.sh: error: checkpoint not found") and "absent.safetensors" in line
    assert not (tmp_path / "art").exists()


def test_bad_device_is_a_usage_error(tmp_path, read_only_checkpoint):
    r = _build(_env(read_only_checkpoint, tmp_path / "art", ENGINE_DEVICE="tpu"))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("build.sh: error: ENGINE_DEVICE must be")


@pytest.mark.parametrize("knob, value", [("ENGINE_PRECISION", "bf61"), ("ENGINE_BATCH_SIZE", "0"),
                                         ("ENGINE_BATCH_SIZE", "many"), ("ENGINE_INPUT_SIZE", "-3"),
                                         ("ENGINE_CROP_MODE", "zoom"), ("FORCE", "yes"), ("ENGINE_BACKEND", "foo"),
                                         ("ENGINE_CROP_PCT", "half"), ("ENGINE_MODEL_KWARGS", "{depth"),
                                         ("ENGINE_BUILD_DEADLINE_S", "soon"), ("ENGINE_BUILD_DEADLINE_S", "-5")])
def test_a_bad_knob_is_one_line_naming_it(knob, value, tmp_path, read_only_checkpoint):
    r = _build(_env(read_only_checkpoint, tmp_path / "art", **{knob: value}))
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and errors[0].startswith(f"build.sh: error: {knob}") and value in errors[0], r.stderr
    assert "usage" not in r.stderr and "cannot check" not in r.stderr
    assert not (tmp_path / "art").exists()


def test_the_checkpoint_records_its_spec_as_build_knobs(read_only_checkpoint, tmp_path):
    from evaluator.contest.selfcheck import recorded_spec

    assert recorded_spec(read_only_checkpoint) == {
        "ENGINE_MODEL": TINY_MODEL, "ENGINE_INPUT_SIZE": str(TINY_INPUT), "ENGINE_CROP_MODE": "squash",
        "ENGINE_CROP_PCT": "1.0", "ENGINE_MODEL_KWARGS": json.dumps(TINY_KWARGS, sort_keys=True)}
    (tmp_path / "plain.pth").write_bytes(b"\x80\x02not safetensors")
    assert recorded_spec(tmp_path / "plain.pth") == {}


def test_a_checkpoint_of_another_model_names_the_knobs(tmp_path, read_only_checkpoint):
    r = _build(_env(read_only_checkpoint, tmp_path / "art", ENGINE_MODEL="eva02_small_patch14_224",
                    ENGINE_INPUT_SIZE="", ENGINE_MODEL_KWARGS="", ENGINE_CROP_MODE="", ENGINE_CROP_PCT=""))
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("build.sh: error:") and "missing keys" in r.stderr
    assert all(k in last for k in ("ENGINE_MODEL", "ENGINE_INPUT_SIZE", "ENGINE_MODEL_KWARGS")), last


def test_a_failed_check_exits_1(first_build):
    art, env, r = first_build
    assert r.returncode == 0, r.stderr[-3000:]
    r2 = _build({**env, "ENGINE_DECODER": "bogus"})   # the artifact is reused; scripts/run refuses the value
    assert r2.returncode == 1, r2.stderr[-3000:]
    assert "reusing artifact" in r2.stderr
    assert r2.stderr.strip().splitlines()[-1].startswith("build.sh: error: the artifact at")


def _read_by_the_build_step() -> set[str]:
    """The variables build.sh reads (`${NAME`) and those evaluator.settings' build_* getters read."""
    import ast

    from evaluator import settings

    names = set(re.findall(r"\$\{((?:ENGINE_[A-Z_]+|FORCE|PYTHON))\b", BUILD.read_text()))
    tree = ast.parse((REPO / "evaluator" / "settings.py").read_text())
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name.startswith("build_"):
            names |= {c.args[0].value for c in ast.walk(fn) if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "read"
                      and isinstance(c.args[0], ast.Constant)}
    return names | set(settings.BUILD_FLAG_KNOBS)


def test_help_lists_every_knob_and_exits_0():
    from engine.presets import PRESETS
    from evaluator import settings
    from evaluator.contest.task import DEFAULT_MODEL

    r = subprocess.run(["sh", str(BUILD), "--help"], capture_output=True, text=True, timeout=30, cwd="/")
    assert r.returncode == 0 and r.stderr == ""
    read = _read_by_the_build_step()
    assert {"ENGINE_CHECKPOINT", "ENGINE_DEVICE", "FORCE", "PYTHON"} <= read <= set(settings.BUILD_ENV) | {"ENGINE_ARTIFACT"}
    for name in settings.BUILD_ENV:
        assert f"  {name} " in r.stdout, f"--help does not list {name}"
    text = " ".join(r.stdout.split())          # the defaults, read where they live
    assert f"the model (evaluator/contest/task.py): {DEFAULT_MODEL}" in text
    assert "(default: /checkpoint/model.safetensors)" in text
    for device, pre in PRESETS.items():
        assert f"{device}: precision {pre.precision}, batch {pre.batch_size}" in text
    assert "exit status: 0 ready, 1 the build or the check failed, 2 a bad knob or a missing input" in text
    bad = subprocess.run(["sh", str(BUILD), "--frobnicate"], capture_output=True, text=True, timeout=30, cwd="/")
    assert bad.returncode == 2 and bad.stderr.startswith("build.sh: error: unknown argument '--frobnicate'")


def test_build_sh_is_a_thin_wrapper_of_the_build_step():
    lines = BUILD.read_text().splitlines()
    assert len(lines) <= 40, len(lines)
    assert lines[-1] == 'exec "$PY" -m evaluator.contest.build_step "$@"'


def test_the_contest_passes_its_guard_budget_and_calibration_check(read_only_checkpoint, tmp_path):
    from engine.presets import PRESETS
    from engine.tuning import parse_args
    from evaluator.contest import build_step, task
    from evaluator.contest.agreement import threshold
    from evaluator.contest.eval_data_signs import calibration_refusals

    assert threshold(task.COHORT_IMAGES) == 9_900 and task.allowed_disagreements() == 100
    # the build's budget: the gate's 100 of 10,000 over a margin of 2, in basis points (decoder and precision)
    assert task.GATE_MARGIN == 2 and task.guard_budget() == 50 > max(p.guard_budget for p in PRESETS.values())
    knobs = {"ENGINE_MODEL": TINY_MODEL, "ENGINE_INPUT_SIZE": str(TINY_INPUT), "ENGINE_PRECISION": "bf16"}
    a = parse_args(build_step.engine_flags(knobs, read_only_checkpoint, tmp_path / "art", "cpu"))
    assert a.calibration_check is calibration_refusals and a.guard_budget == 50 and a.run_images == task.COHORT_IMAGES
    assert (a.precision, a.input_size, a.device, a.out) == ("bf16", TINY_INPUT, "cpu", tmp_path / "art")


def test_a_gpu_torch_cannot_use_is_a_usage_error(tmp_path, read_only_checkpoint):
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees the GPU here")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = _env(read_only_checkpoint, tmp_path / "art", PATH=f"{fake}:{os.environ['PATH']}")
    r = _build(env)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("build.sh: error: nvidia-smi lists a GPU but torch.cuda cannot use it") and \
        "ENGINE_DEVICE=cpu" in last
    assert not (tmp_path / "art").exists()
