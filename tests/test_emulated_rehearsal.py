"""The ARM64 image rehearsal under emulation (evaluator.rehearsal.emulated, `image --arch aarch64`): the
argument, the plan (which pins for which architecture, the command lines), and a host that cannot run
it (a missing tool, no binfmt_misc) ending in one line. The real rehearsal (root, qemu, about an hour)
is the one `emulated` test, skipped unless selected with `-m emulated`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

from evaluator.rehearsal import emulated, image, image_steps
from evaluator.rehearsal import emulated_plan as plan

LOCKS = {lock: (REPO / lock).read_text()
         for lock in image_steps.pip_locks(image_steps.instructions((REPO / "Dockerfile").read_text()))}


def test_arch_is_validated_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        image.main(["--arch", "armv7l"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "argument --arch: invalid choice: 'armv7l'" in err and "aarch64" in err and "Traceback" not in err


def test_arch_defaults_to_x86_64_and_aarch64_refuses_the_venv_options(capsys):
    assert image.ARCHES[0] == "x86_64"
    with pytest.raises(SystemExit) as e:
        image.main(["--arch", "aarch64", "--quick"])
    assert e.value.code == 2 and "--quick, --venv and --codegen are the x86_64 rehearsal's" in capsys.readouterr().err


def test_pins_follow_the_target_architecture_not_this_machine():
    arm = plan.arch_pins(LOCKS, "aarch64")
    x86 = plan.arch_pins(LOCKS, "x86_64")
    arm_pins, x86_pins = [p for _, p in arm], [p for _, p in x86]
    # torch-tensorrt's aarch64 wheel needs the `tensorrt` metapackage: only the aarch64 plan has it
    assert "tensorrt==11.1.0.106" in arm_pins and "tensorrt==11.1.0.106" not in x86_pins
    assert set(arm_pins) - set(x86_pins) == {"tensorrt==11.1.0.106"}
    # every Linux-only CUDA pin is in both, and each pin keeps the lock it came from, in order
    assert "torch==2.14.1" in arm_pins and "nvidia-cuda-crt==13.0.88" in arm_pins
    assert dict(arm)["requirements/lock.txt"] and [lk for lk, _ in arm][-1] == "requirements/gpu.txt"
    assert ("requirements/gpu.txt", "torch-tensorrt==2.14.0") in arm


def test_pins_evaluate_markers_extras_and_comments():
    text = """# a comment
a==1
b[x,y]==2; platform_machine == "aarch64"
c==3; platform_machine == "x86_64"
d==4; sys_platform == "darwin"
"""
    assert plan.arch_pins({"l.txt": text}, "aarch64") == [("l.txt", "a==1"), ("l.txt", "b[x,y]==2")]
    assert plan.arch_pins({"l.txt": text}, "x86_64") == [("l.txt", "a==1"), ("l.txt", "c==3")]


def test_download_command_asks_for_aarch64_wheels_up_to_bookworms_glibc(tmp_path):
    cmd = plan.download_command(["torch==2.14.1", "numpy==2.4.6"], tmp_path, python="py")
    assert cmd[:3] == ["py", "-m", "pip"] and cmd[3] == "download"
    for flag in ("--no-deps", "--only-binary=:all:"):
        assert flag in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.11" and cmd[cmd.index("-d") + 1] == str(tmp_path)
    plats = [cmd[i + 1] for i, t in enumerate(cmd) if t == "--platform"]
    assert plats[0] == "manylinux2014_aarch64" and plats[-1] == "manylinux_2_36_aarch64"
    assert "manylinux_2_28_aarch64" in plats and not [p for p in plats if "x86_64" in p or "2_37" in p]
    assert cmd[-2:] == ["torch==2.14.1", "numpy==2.4.6"]
    assert plan.sdist_command("tensorrt==11.1.0.106", tmp_path, python="py")[-1] == "tensorrt==11.1.0.106"
    assert "--no-binary=:all:" in plan.sdist_command("x==1", tmp_path)


def test_root_and_install_commands(tmp_path):
    stage1, stage2 = plan.debootstrap_commands(tmp_path / "root")
    assert stage1[:4] == ["debootstrap", "--foreign", "--arch=arm64", "--variant=minbase"]
    assert "--include=python3,python3-venv,python3-pip,g++" in stage1 and stage1[-3:-1] == ["bookworm", str(tmp_path / "root")]
    assert stage2 == ["chroot", str(tmp_path / "root"), "/debootstrap/debootstrap", "--second-stage"]
    venv, wheels, sdist = plan.install_commands(["a==1", "b==2"], ["tensorrt==11.1.0.106"])
    assert venv == ["python3", "-m", "venv", "--clear", "/opt/venv"]
    assert "--no-deps" in wheels and "--no-index" in wheels and wheels[-2:] == ["a==1", "b==2"]
    assert "--no-deps" in sdist and "--no-index" not in sdist and sdist[-1] == "tensorrt==11.1.0.106"
    cmd = plan.in_root(tmp_path, ["python", "-c", "x"], {"A": "1"}, cwd="/submission")
    assert cmd[:5] == ["chroot", str(tmp_path), "/usr/bin/env", "-i", f"PATH={plan.BASE_ENV['PATH']}"]
    assert "A=1" in cmd and "HOME=/root" in cmd
    assert cmd[-4:] == ["/submission", "python", "-c", "x"]


def test_missing_tools_are_named_in_one_line():
    none = plan.host_refusal(which=lambda tool: None, euid=0, machine="x86_64")
    assert none.startswith("missing on this machine: debootstrap (debootstrap)") and "qemu-user-static" in none
    assert "\n" not in none
    assert plan.host_refusal(which=lambda tool: "/bin/" + tool, euid=1000, machine="x86_64").startswith(
        "debootstrap, chroot and mount need root")
    assert plan.host_refusal(which=lambda tool: "/bin/" + tool, euid=0, machine="x86_64") is None
    # an arm64 host runs the root without qemu
    no_qemu = lambda tool: None if tool == plan.QEMU else "/bin/" + tool  # noqa: E731
    assert plan.host_refusal(which=no_qemu, euid=0, machine="aarch64") is None


def test_binfmt_entry_is_found_or_its_absence_said_in_one_line(tmp_path):
    (tmp_path / "register").write_text("")
    (tmp_path / "qemu-aarch64").write_text("enabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\n"
                                           "flags: PF\noffset 0\nmagic 7f454c460201010000000000000000000200b700\n")
    assert plan.ensure_binfmt("x86_64", tmp_path) is None
    (tmp_path / "qemu-aarch64").write_text("disabled\n")
    unregistered = plan.ensure_binfmt("x86_64", tmp_path, run=lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "no"))
    assert unregistered.startswith("no aarch64 entry in") and "\n" not in unregistered
    unmounted = tmp_path / "absent"
    failed = plan.ensure_binfmt("x86_64", unmounted,
                                    run=lambda *a, **k: subprocess.CompletedProcess(a, 32, "", "permission denied\n"))
    assert failed == f"binfmt_misc is not mounted at {unmounted} and mounting it failed: permission denied"


def test_a_host_without_the_tools_ends_in_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plan.shutil, "which", lambda tool: None)
    monkeypatch.setattr(emulated, "build_root", lambda ctx: pytest.fail("went past the host check"))
    rc = image.main(["--arch", "aarch64", "--cache", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert err.splitlines() == [f"python -m evaluator.rehearsal.image: error: {plan.host_refusal(which=lambda t: None)}"]
    assert "debootstrap" in err


def test_a_cache_folder_this_kit_did_not_make_is_refused(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("x")
    with pytest.raises(SystemExit) as e:
        image.main(["--arch", "aarch64", "--cache", str(tmp_path)])
    assert e.value.code == 2 and "holds files this kit did not make" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


def test_record_has_the_verdict_and_each_steps_seconds(tmp_path):
    steps = [image_steps.Step("host", True, "x", 0.5), image_steps.Step("root", False, "y", 2.25)]
    doc = emulated.record(steps, tmp_path)
    assert doc["ok"] is False and doc["arch"] == "aarch64" and doc["total_s"] == 2.8
    assert [(s["name"], s["seconds"]) for s in doc["steps"]] == [("host", 0.5), ("root", 2.25)]
    assert steps[0].line() == "ok      host: x [0.5 s]"
    json.dumps(doc)


@pytest.mark.emulated
@pytest.mark.slow
@pytest.mark.abi
def test_the_emulated_arm64_rehearsal_passes(tmp_path):
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        pytest.skip("needs root and debootstrap, qemu-user-static")
    out = tmp_path / "arm64.json"
    r = subprocess.run([sys.executable, "-m", "evaluator.rehearsal.image", "--arch", "aarch64", "--json", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=4 * 3600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["ok"] and [s["name"] for s in doc["steps"]][-1] == "agree"


def test_the_emulated_root_sees_an_arm64_cpu_in_sys(tmp_path):
    """torch's oneDNN reads MIDR_EL1 from sysfs when torch loads and crashed (SIGSEGV) under qemu-user on an
    x86_64 kernel, which has no such entry: the root's /sys is a stand-in that has it for every CPU."""
    sys_dir = emulated.arm64_sys(tmp_path / "sys", 3)
    cpu = sys_dir / "devices" / "system" / "cpu"
    midrs = sorted((cpu / f"cpu{i}" / "regs" / "identification" / "midr_el1").read_text() for i in range(3))
    assert midrs == ["0x00000000410fd4f0\n"] * 3            # Neoverse V2: implementer 0x41 (Arm), part 0xd4f
    assert (cpu / "possible").read_text() == "0-2\n" and (cpu / "online").read_text() == "0-2\n"
