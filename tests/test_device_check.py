"""The one-shot GPU check: without a GPU it ends in seconds with a JSON; on the CPU with the
tiny model it runs every step's code in the order the GPU run does (the GPU run is the same
code); cut by its deadline it keeps the first steps and names those that did not run;
stopped mid-build it leaves a small result folder, a valid JSON and no work files."""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
from device_aot import merged_home, wheel_homes  # noqa: E402 - a script's module, not a package
from device_check import PLAN  # noqa: E402
from device_harness import Check  # noqa: E402
from device_probes import TORCH_NEEDS, not_exercised, scored_setup, torch_lacks  # noqa: E402

pytestmark = pytest.mark.abi   # scripts/device_check.sh / .py as whole processes

ORDER = ["driver", "env", "cuda_home", "cohort", "checkpoint", "aot_bf16", "eager_bf16", "abi_eager_bf16", "reference",
         "abi_aot_bf16", "search", "packages", "fp8_gemm", "graph_capture", "decoder_race", "attention", "topk",
         "abi_aot_bf16_no_graphs", "abi_aot_bf16_raw", "gpu_tests", "eager_fp16", "eager_fp8", "eager_fp8-torchao",
         "batch_sweep"]
OUTPUTS = ["aot_phases.json", "device_check.json", "device_check.log", "results.jsonl"]
TINY = ["--tiny", "--device", "cpu", "--count", "24", "--ref-count", "24", "--batch-size", "8",
        "--gpu-tests-s", "60", "--calibration-count", "32", "--search-budget-s", "5"]


def tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def processes_naming(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text`."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and text.encode() in (d / "cmdline").read_bytes():
                pids.append(int(d.name))
        except OSError:
            pass
    return pids


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_a_gpu_it_ends_in_seconds_and_says_so(tmp_path):
    t = time.perf_counter()
    r = subprocess.run([str(REPO / "scripts" / "device_check.sh"), str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr
    assert time.perf_counter() - t < 60
    doc = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert doc["status"] == "no-gpu" and "no CUDA GPU" in doc["note"] and doc["steps"]["env"]["torch"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["device_check.json", "results.jsonl"]


def test_cpu_rehearsal_runs_every_step_in_order_and_keeps_only_small_files(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "device_check.py"), "--out", str(out), *TINY,
                        "--limit-s", "1200"], capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "device_check.json").read_text())
    steps = doc["steps"]
    assert list(steps) == ORDER == [n for n, _, _ in PLAN] and doc["not_run"] == []
    assert steps["graph_capture"] == {"skipped": "no CUDA", "seconds": steps["graph_capture"]["seconds"],
                                      "timeout_s": steps["graph_capture"]["timeout_s"]}
    assert steps["gpu_tests"]["skipped"] == "no CUDA: every gpu-marked test would skip"
    assert steps["abi_aot_bf16_no_graphs"] == {"skipped": "no CUDA: the CPU runs without graphs already"}
    assert not [n for n, s in steps.items() if "error" in s or "running" in s or
                ("skipped" in s and n not in ("graph_capture", "gpu_tests", "abi_aot_bf16_no_graphs"))], steps
    pk = steps["packages"]["packages"]
    assert pk["torchvision"]["ok"] and pk["torchvision_cuda_decode"] == {"ok": False, "error": "skipped: no CUDA"}
    assert steps["driver"]["source"] in ("nvidia-smi", "torch")
    layout = steps["cuda_home"]
    assert layout["cuda_home"] in (layout["wheel_home"], layout.get("system_home"), None)
    assert (layout["finding"] is None) == bool(layout["wheel_headers"]["ok"])
    build = steps["aot_bf16"]
    assert build["calibration_source"] == ("photos" if pk["scikit-image"]["ok"] else "renders")
    assert build["calibration_count"] == 32 and build["waited_s"] >= 0 and build["tau"] >= 0
    assert build["cuda_home"] == layout["cuda_home"] and build["phases"]["cpp_compile"]
    ph = build["phases_s"]               # export, Inductor less its C++ compiles, C++ compiles, load, first call
    assert all(ph[k] > 0 for k in ("export", "inductor", "cpp_compile", "first_call")) and ph["lowering"] >= 0 <= ph["load"]
    assert ph["inductor"] == pytest.approx(ph["lowering"] + ph["cpp_compile"], abs=0.01)
    assert not [c for cs in build["phases"].values() for c in cs if "error" in c]
    assert build["estimated_per_10k"] <= build["budget_per_10k"] and steps["reference"]["images"] == 24
    first = steps["abi_eager_bf16"]              # the early ABI figure, its agreement added by the reference
    assert first["images_per_s_steady"] > 0 and first["agreement_rate"] >= 0.95 and first["guard"]["images"] == 24
    search = steps["search"]
    assert search["budget_s"] == 5 and search["chose"]["backend"] and search["candidates"] and search["deadline_s"] > 0
    abi = steps["abi_aot_bf16"]
    assert abi["agreement_rate"] >= 0.95 and abi["cuda_graph"] == "off" and abi["guard"]["images"] == 24
    assert abi["decoder"] == ("dali-cpu" if pk["nvidia.dali"]["ok"] else "pil")
    side = steps["abi_aot_bf16_raw"]["guard_side_by_side"]   # raw vs guarded, the re-checks' share and time
    assert side["guarded_agreement"] == abi["agreement"] and side["rechecked_fraction"] == abi["guard"]["fraction"]
    assert side["raw_agreement_rate"] >= 0.95 and side["recheck_seconds"] >= 0
    fp8 = steps["fp8_gemm"]
    assert fp8["exact"] and set(fp8["layers"]) == {"qkv", "proj", "swiglu_fc1", "fc2"}
    assert all(v["fp8_vs_fp32"] < 0.1 and v["bf16_vs_fp32"] < 1e-2 for v in fp8["layers"].values())
    race = steps["decoder_race"]["decoders"]["torchvision"]
    assert race["protocol_holds"] and race["record_stream"]["mismatches"] == 0
    assert steps["eager_fp8"]["agreement_rate"] >= 0.5 and "guard_side_by_side" in steps["eager_fp16"]
    assert steps["attention"]["fastest"] == "math" and steps["topk"]["validated"]
    assert doc["status"] == "done" and not doc["alarms"]
    gaps = doc["not_exercised"]
    assert "Hopper GPU (ran without CUDA)" in gaps and any("tiny test model" in g for g in gaps)
    assert (platform.machine() == "aarch64") != any(g.startswith("architecture aarch64") for g in gaps)
    # only small plain files in the result folder; the work folder (checkpoint, artifacts, cohort) is gone
    files = sorted(p.name for p in out.iterdir())
    assert files == OUTPUTS and tree_bytes(out) < 1 << 20
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {x["step"] for x in lines} == set(ORDER), lines   # every step landed its line, as it ended
    at = {x["step"]: x for x in lines if "added" not in x}
    # the AOT figure lands before the search starts, after the eager figure and its agreement
    assert at["abi_eager_bf16"]["landed_s"] <= at["reference"]["landed_s"] <= at["aot_bf16"]["landed_s"] <= \
        at["abi_aot_bf16"]["started_s"] <= at["abi_aot_bf16"]["landed_s"] <= at["search"]["started_s"]
    assert [x for x in lines if "added" in x][0]["agreement"] == first["agreement"]
    assert json.loads((out / "aot_phases.json").read_text())["seconds"] == ph
    assert "==== aot_bf16 (exit 0" in (out / "device_check.log").read_text()
    assert doc["work_dir_removed"] and not Path(doc["work_dir"]).exists()


@pytest.mark.slow
def test_a_sigkill_mid_build_leaves_every_result_reached_and_the_aot_phases_so_far(tmp_path):
    """The device tool kills a command at its limit: whatever the check reached must already be
    in its folder. Killed with SIGKILL (no teardown) while AOTInductor compiles in the background,
    the folder holds a whole line per landed result and the build's phases that ended."""
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, str(REPO / "scripts" / "device_check.py"), "--out", str(out), *TINY,
                          "--limit-s", "1200"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                         process_group=0)
    work, phases = None, {}
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline and p.poll() is None:
            try:
                work = work or json.loads((out / "device_check.json").read_text()).get("work_dir")
                phases = json.loads((out / "aot_phases.json").read_text())
            except (OSError, ValueError):
                pass
            if "export" in phases.get("phases", {}):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the build never exported: {p.poll()} {p.stderr.read()[-2000:] if p.poll() is not None else ''}")
        os.killpg(p.pid, signal.SIGKILL)                   # the check, no teardown
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        if work:                                           # its children, each in its own group, and the work folder
            for pid in processes_naming(work):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            shutil.rmtree(work, ignore_errors=True)
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]   # whole lines only
    assert [x["step"] for x in lines][:4] == ["driver", "env", "cuda_home", "checkpoint"], lines
    assert all(x["landed_s"] >= (x["started_s"] or 0) for x in lines)
    assert lines[3]["recipe"]["model"] and "error" not in lines[3]
    doc = json.loads((out / "device_check.json").read_text())
    assert "running" in doc["steps"]["aot_bf16"] and doc["status"] == "running"      # the kill left no teardown
    kept = json.loads((out / "aot_phases.json").read_text())
    assert kept["seconds"]["export"] > 0 and kept["phases"]["export"][0]["s"] > 0


def test_sigterm_mid_build_leaves_a_small_result_folder_and_a_json_naming_each_step(tmp_path):
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, str(REPO / "scripts" / "device_check.py"), "--out", str(out), *TINY,
                          "--limit-s", "1200"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    doc: dict = {}
    deadline = time.monotonic() + 600
    try:   # wait until the build compiles in the background and a foreground step is under way
        while time.monotonic() < deadline and p.poll() is None:
            try:
                doc = json.loads((out / "device_check.json").read_text())
            except (OSError, ValueError):
                doc = {}
            steps = doc.get("steps", {})
            if "running" in steps.get("aot_bf16", {}) and "running" in steps.get(list(steps)[-1], {}) and \
                    list(steps)[-1] != "aot_bf16":
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the build never ran in the background: {doc}")
        work = doc["work_dir"]
        assert Path(work).is_dir() and processes_naming(work)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
    doc = json.loads((out / "device_check.json").read_text())
    steps = doc["steps"]
    assert doc["status"] == "stopped (SIGTERM)" and list(steps) == ORDER[:len(steps)]
    assert all("seconds" in steps[n] and "error" not in steps[n] for n in ("driver", "env", "cuda_home", "checkpoint"))
    assert "interrupted" in steps["aot_bf16"] and "interrupted" in steps[list(steps)[-1]]
    assert not [n for n, s in steps.items() if "running" in s]
    assert tree_bytes(out) < 50 << 20 and set(x.name for x in out.iterdir()) <= set(OUTPUTS)
    assert "==== aot_bf16" in (out / "device_check.log").read_text()   # the cut build's output tail
    assert not Path(work).exists() and not processes_naming(work)            # children stopped, work removed
    assert doc["not_exercised"] and doc["not_run"] == ORDER[len(steps):]


def test_a_short_limit_keeps_the_first_steps_and_names_those_that_did_not_run(tmp_path):
    out, limit = tmp_path / "out", 12
    t = time.perf_counter()
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "device_check.py"), "--out", str(out), *TINY,
                        "--limit-s", str(limit)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert time.perf_counter() - t < limit + 30, r.stderr[-2000:]
    doc = json.loads((out / "device_check.json").read_text())
    steps = doc["steps"]
    assert r.returncode == 1 and doc["status"] == "incomplete" and doc["limit_s"] == limit, r.stderr[-2000:]
    assert list(steps) == ORDER[:len(steps)] and doc["not_run"] == ORDER[len(steps):]
    assert all("seconds" in steps[n] and "error" not in steps[n] for n in ("driver", "env", "cuda_home"))
    assert "abi_eager_bf16" in doc["not_run"] and "batch_sweep" in doc["not_run"]
    shares = {n: share for n, share, _ in PLAN}
    for name, s in steps.items():               # each step stopped at its own share of the limit
        if "timeout_s" in s:
            assert s["timeout_s"] <= shares[name] * limit + 0.1 and s["seconds"] <= s["timeout_s"] + 8, (name, s)
    assert any("timed_out" in s for s in steps.values()) or "checkpoint" in doc["not_run"] or \
        "skipped" in steps.get("aot_bf16", {}), steps
    assert doc["work_dir_removed"] and set(x.name for x in out.iterdir()) <= set(OUTPUTS)


def test_the_wrapper_prints_its_help_and_every_option_says_its_default():
    r = subprocess.run([str(REPO / "scripts" / "device_check.sh"), "--help"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    text = " ".join(r.stdout.split())
    assert text.startswith("One-shot GPU check") and "scripts/device_check.sh [OUTDIR] [OPTIONS]" in text
    block = r.stdout.split("\noptions:\n")[1].split("\n\n")[0]       # argparse's options section
    helps = {m.group(1): " ".join(m.group(2).split()) for m in re.finditer(r"^  (-[-\w]+)[^\n]*?((?:\n {6,}.*|.*)*)",
                                                                         block, re.M)}
    assert {"--out", "--limit-s", "--search-budget-s", "--system-cuda"} <= set(helps)
    for opt, text in helps.items():
        assert opt == "-h" or "(default: " in text or "(required" in text, (opt, text)
    assert all(f"  {n} " in r.stdout for n, _, _ in PLAN)          # the steps, in order, with what they tell


def test_not_exercised_compares_the_run_with_the_lock_and_the_dockerfile():
    scored = scored_setup(REPO)
    lock = (REPO / "requirements" / "lock.txt").read_text()
    assert f"torch=={scored['pins']['torch']}\n" in lock and scored["python"] in (REPO / "Dockerfile").read_text()
    doc = {"steps": {"env": {"machine": "x86_64", "gpu": {"name": "NVIDIA H200", "capability": "9.0"}},
                     "packages": {"packages": {"nvidia.dali": {"ok": False, "error": "not installed"}}},
                     "cuda_home": {"wheel_home": "/sp/nvidia/cu13", "cuda_home": "/usr/local/cuda",
                                   "wheel_headers": {"ok": False, "missing": "crt/host_defines.h"}},
                     "aot_bf16": {"calibration_source": "renders", "calibration_count": 64, "backend": "aot",
                                  "recheck_backend": "eager"},
                     "abi_aot_bf16": {"decoder": "nvjpeg", "cuda_graph": "captured"}}}
    gaps = not_exercised(doc, {**scored, "python": "2.7"})
    assert "architecture aarch64 (ran on x86_64)" in gaps and not any(g.startswith("Hopper") for g in gaps)
    assert "decoder dali-gpu (DALI not installed; the ABI decoded with nvjpeg)" in gaps
    assert f"python 2.7 (ran {platform.python_version()})" in gaps and "calibration on 256 photos (ran 64 renders)" in gaps
    assert not any(g.startswith("CUDA graph") for g in gaps)
    assert "the image's CUDA_HOME layout /sp/nvidia/cu13 (crt/host_defines.h; built with /usr/local/cuda)" in gaps
    assert "an aot re-check graph (the guard re-checked with eager)" in gaps
    assert "the measured search (not run)" in gaps
    doc["steps"]["cuda_home"]["cuda_home"] = "/sp/nvidia/cu13"
    doc["steps"]["aot_bf16"]["recheck_backend"] = "aot"
    doc["steps"]["search"] = {"chose": {"backend": "aot"}}
    gaps = not_exercised(doc, scored)
    assert not [g for g in gaps if "CUDA_HOME" in g or "re-check graph" in g or "measured search" in g], gaps


def test_cuda_wheel_folders_split_over_sys_path_are_found_and_merged_into_one_home(tmp_path, monkeypatch):
    """Carried header wheels unpacked into a folder on PYTHONPATH hold nvidia/cu13/include/crt
    only; the installed CUDA wheels' nvidia/ is a regular package (an __init__.py), which hides
    any other nvidia/ from the import system. Both folders are found, and their union is the
    image's CUDA_HOME: every include/ and lib/ entry, the first folder's winning."""
    carry, site = tmp_path / "carry", tmp_path / "site"
    (carry / "nvidia" / "cu13" / "include" / "crt").mkdir(parents=True)
    (carry / "nvidia" / "cu13" / "include" / "crt" / "host_defines.h").write_text("// carried\n")
    (carry / "nvidia" / "cu13" / "include" / "cuda.h").write_text("// carried copy\n")
    (site / "nvidia" / "cu13" / "include").mkdir(parents=True)
    (site / "nvidia" / "cu13" / "lib").mkdir()
    (site / "nvidia" / "__init__.py").write_text("")
    (site / "nvidia" / "cu13" / "include" / "cuda.h").write_text("// installed\n")
    (site / "nvidia" / "cu13" / "include" / "cuda_runtime.h").write_text('#include "crt/host_defines.h"\n')
    (site / "nvidia" / "cu13" / "lib" / "libcudart.so.13").write_text("")
    (site / "nvidia" / "cudnn").mkdir()                               # not a cuNN folder
    monkeypatch.setattr(sys, "path", [str(carry), str(site)])
    homes = wheel_homes()
    assert homes == [carry / "nvidia" / "cu13", site / "nvidia" / "cu13"]
    home = merged_home(homes, tmp_path / "merged" / "cu13")
    inc = home / "include"
    assert sorted(p.name for p in inc.iterdir()) == ["crt", "cuda.h", "cuda_runtime.h"]
    assert (inc / "crt" / "host_defines.h").read_text() == "// carried\n"
    assert (inc / "cuda.h").read_text() == "// carried copy\n"                 # the first folder's entry wins
    assert (home / "lib" / "libcudart.so.13").is_file()


def test_a_step_calling_what_this_torch_lacks_is_skipped_in_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """A lent machine's torch may be older than the lock's: a step that calls a torch name it lacks
    is skipped with that name (in the JSON, its results line and one stderr line), never run."""
    monkeypatch.setitem(TORCH_NEEDS, "fp8_gemm", ("_scaled_mm", "no_such_fp8_gemm"))
    monkeypatch.setitem(TORCH_NEEDS, "attention", ("nn.attention.sdpa_kernel",))
    lacks = torch_lacks()
    assert lacks["fp8_gemm"] == ["torch.no_such_fp8_gemm"] and "attention" not in lacks
    c = Check(tmp_path, 60.0, PLAN)
    c.doc["steps"]["env"] = {"torch": torch.__version__}
    c.lacks = lacks
    ran = []
    assert c.step("fp8_gemm", lambda: ran.append(1) or {}) is None and not ran
    want = f"torch {torch.__version__} lacks torch.no_such_fp8_gemm"
    assert c.doc["steps"]["fp8_gemm"] == {"skipped": want}
    assert json.loads((tmp_path / "results.jsonl").read_text())["skipped"] == want
    assert capsys.readouterr().err == f"device_check: fp8_gemm: skipped: {want}\n"
    assert c.step("attention", lambda: {"ok": True})["ok"]
