"""The image rehearsal (evaluator.rehearsal.image): the Dockerfile parsed, and the AOTInductor CUDA
header compile against the installed lock (CI installs it, so the compile runs there)."""
from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
from conftest import REPO

from evaluator.rehearsal import image, image_steps

SP = sysconfig.get_paths()["purelib"]


def _cuda_home() -> Path:
    env = image_steps.mapped_env(image_steps.instructions((REPO / "Dockerfile").read_text()), SP)
    return Path(env["CUDA_HOME"])


def _need_toolchain() -> Path:
    cuda_home = _cuda_home()
    if shutil.which("g++") is None or not (cuda_home / "include").is_dir():
        pytest.skip(f"needs g++ and the CUDA 13 wheels' headers ({cuda_home}/include): install requirements/lock.txt")
    return cuda_home


def test_dockerfile_env_of_the_real_dockerfile():
    instrs = image_steps.instructions((REPO / "Dockerfile").read_text())
    env = image_steps.dockerfile_env(instrs)
    assert env["CUDA_HOME"] == "/usr/local/lib/python3.11/site-packages/nvidia/cu13"
    assert env["TMPDIR"] == "/tmp" and env["HF_HUB_OFFLINE"] == "1"
    assert image_steps.mapped_env(instrs, "/venv/sp")["CUDA_HOME"] == "/venv/sp/nvidia/cu13"
    assert image_steps.pip_locks(instrs) == ["requirements/lock.txt", "requirements/gpu.txt"]
    checks = image_steps.import_checks(instrs)
    assert [c.fallback is None for c in checks] == [True, False], checks
    assert "import sys, torch" in checks[0].code and "cupy" in checks[0].code and "${TARGETARCH}" in checks[0].code
    assert "torch_tensorrt" in checks[1].code and "no GPU" in checks[1].fallback


def test_dockerfile_env_continuations_and_substitution():
    text = """FROM python:3.12-slim-bookworm
ARG BASE="/opt"
ARG TARGETARCH
# a comment
ENV A=1 \\
    # a comment inside the continuation
    B="two words" \\
    C=${BASE}/c
ENV LEGACY some value
ENV D=${C}/d E=$A${MISSING} F=${MISSING:-dflt} G=${A:+set} H=${MISSING:+set}
RUN python -c "import os; print('${A}')" || echo "fell back"
"""
    instrs = image_steps.instructions(text)
    env = image_steps.dockerfile_env(instrs)
    assert env == {"A": "1", "B": "two words", "C": "/opt/c", "LEGACY": "some value", "D": "/opt/c/d",
                   "E": "1", "F": "dflt", "G": "set", "H": ""}
    assert image_steps.image_site_packages(instrs) == "/usr/local/lib/python3.12/site-packages"
    assert image_steps.import_checks(instrs)[0].fallback == "fell back"
    with pytest.raises(ValueError, match="continuation"):
        image_steps.instructions("FROM x\nENV A=1 \\\n")


def test_cuda_headers_compile_against_the_installed_lock():
    cuda_home = _need_toolchain()
    step = image_steps.quick(REPO / "Dockerfile", SP)
    assert step.ok, step.line()
    assert str(cuda_home) in step.detail


def test_header_compile_fails_without_crt(tmp_path):
    """The same compile against a copy of CUDA_HOME without crt/ names the missing header."""
    cuda_home = _need_toolchain()
    copy = tmp_path / "cu13"
    shutil.copytree(cuda_home / "include", copy / "include", ignore=shutil.ignore_patterns("crt"))
    step = image_steps.compile_headers(SP, str(copy), headers=("cuda_fp16.h",))
    assert not step.ok
    assert "fatal error: crt/host_defines.h: No such file or directory" in step.detail, step.detail
    assert step.line().startswith("FAILED  headers: <cuda_fp16.h>")


def test_quick_cli_fails_and_writes_the_summary(tmp_path, capsys):
    """A Dockerfile whose CUDA_HOME has no headers: exit 1, one FAILED line, the JSON summary."""
    df = tmp_path / "Dockerfile"
    df.write_text("FROM python:3.11-slim\nENV CUDA_HOME=/usr/local/lib/python3.11/site-packages/no/such/cuda\n")
    rc = image.main(["--quick", "--dockerfile", str(df), "--json", str(tmp_path / "s.json")])
    summary = json.loads((tmp_path / "s.json").read_text())
    assert rc == 1 and not summary["ok"] and [s["name"] for s in summary["steps"]] == ["headers"]
    out = capsys.readouterr()
    assert out.out.startswith(f"FAILED  headers: CUDA_HOME={SP}/no/such/cuda has no include/ folder"), out.out
    assert "image rehearsal: FAIL" in out.err


def test_missing_header_line():
    err = "In file included from x.h:1:\n/p/cuda_runtime.h:82:10: fatal error: crt/host_config.h: No such file or directory\n"
    assert image_steps.missing_header(err) == "/p/cuda_runtime.h:82:10: fatal error: crt/host_config.h: No such file or directory"
    assert image_steps.missing_header("x.cc:1: error: expected ';'") is None


@pytest.mark.slow
def test_cuda_codegen_and_sm90_cubin_without_a_gpu():
    """Inductor generates CUDA code for a tiny graph, Triton's ptxas makes sm_90 cubins and the
    AOTInductor C++ model compiles against CUDA_HOME, in a subprocess (it patches torch.cuda)."""
    import sys

    from evaluator.rehearsal import image_codegen

    cuda_home = _need_toolchain()
    ok, detail = image_codegen.run_in(Path(sys.executable), {"CUDA_HOME": str(cuda_home)})
    assert ok, detail
    assert "cubin(s) ['sm_90a']" in detail and "C++ model compiled" in detail


def _stub_venv(tmp_path, script: str) -> Path:
    """A venv whose bin/python is a sh script (pip's answers, scripted)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\n" + script)
    (venv / "bin" / "python").chmod(0o755)
    return venv


def test_install_skips_only_pins_no_index_serves(tmp_path):
    lock = tmp_path / "gpu.txt"
    lock.write_text("# a comment\nserved==1\nnvonly==2; platform_system == \"Linux\"\n")
    venv = _stub_venv(tmp_path, """case "$*" in
  *" -r "*) exit 1 ;;
  *nvonly*) echo "ERROR: No matching distribution found for nvonly==2" >&2; exit 1 ;;
  *broken*) echo "ERROR: Could not install packages due to an OSError: disk full" >&2; exit 1 ;;
esac
""")
    lines = []
    step, skipped = image_steps.install_locks(venv, [str(lock)], log=lines.append)
    assert step.ok and skipped == ["nvonly"], (step, skipped)
    assert "1 of 2 pins" in step.detail and lines == [
        f"skipped nvonly ({lock}): nvonly==2 is not installable from the indexes configured here "
        "(the image gets it from NVIDIA's index)"]
    lock.write_text("served==1\nbroken==3\n")
    step, _ = image_steps.install_locks(venv, [str(lock)], log=lines.append)
    assert not step.ok and step.detail.endswith("broken==3: ERROR: Could not install packages due to an OSError: disk full")


def test_pip_check_forgives_only_the_skipped_pins(tmp_path):
    venv = _stub_venv(tmp_path, """echo "torch-tensorrt 2.14.0 requires tensorrt-cu13-libs, which is not installed."
echo "timm 1.0 requires huggingface-hub, which is not installed."
exit 1
""")
    step = image_steps.pip_check(venv, ["tensorrt_cu13_libs"])
    assert not step.ok and step.detail == "timm 1.0 requires huggingface-hub, which is not installed.", step
    assert image_steps.pip_check(venv, ["tensorrt-cu13-libs", "huggingface-hub"]).ok
