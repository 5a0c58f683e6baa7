"""AOT compile facts for scripts/device_check.py: the driver, the CUDA headers Inductor would
compile against in the image's layout, and engine.build with its AOTInductor phases timed.

    python3 scripts/device_aot.py driver
    python3 scripts/device_aot.py cuda_home [--system /usr/local/cuda] [--merge-into DIR]
    python3 scripts/device_aot.py build --phases FILE -- ENGINE_BUILD_ARGS...

The image (Dockerfile) has no CUDA toolkit: CUDA_HOME points at the CUDA wheels' folder
(site-packages/nvidia/cu13 for torch's CUDA 13 wheels), whose headers AOTInductor's C++
wrapper includes. `cuda_home` finds that folder for the torch installed here, compiles the
headers the wrapper includes against it, and names a missing one (e.g. crt/host_config.h,
which cuda_runtime.h includes and a wheel set without the CRT headers lacks); then the
toolkit at --system is tried, and the CUDA_HOME to build with is chosen.
`build` runs `python -m engine.build` in this process with timers around its phases
(torch.export, AOTInductor as a whole, each C++ compiler call inside it, loading the .so
and the first call of the loaded graph), rewriting FILE (whole, fsynced) after each, so a
stopped build still says how far it got.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from engine.io import write_atomic  # noqa: E402 - after the path setup

# what AOTInductor's CUDA runtime headers include (torch/csrc/inductor/aoti_runtime/utils_cuda.h)
CUDA_HEADERS = ("cuda.h", "cuda_runtime_api.h", "cuda_runtime.h", "cuda_bf16.h", "cuda_fp16.h", "cuda_fp8.h")
SMI_FIELDS = ("name", "driver_version", "compute_mode", "persistence_mode", "mig.mode.current", "memory.total",
              "clocks.max.sm", "power.limit")


def driver(timeout: float = 15.0) -> dict:
    """Driver version and compute mode per GPU from nvidia-smi; without it, what torch says
    (the CUDA driver API version; compute mode unknown)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=timeout)
            if r.returncode == 0 and r.stdout.strip():
                gpus = [dict(zip(SMI_FIELDS, (v.strip() for v in line.split(","))))
                        for line in r.stdout.strip().splitlines()]
                out = {"source": "nvidia-smi", "gpus": gpus}
                modes = {g.get("compute_mode") for g in gpus}
                if modes - {"Default"}:
                    out["warning"] = (f"compute mode {sorted(modes)}: an exclusive mode lets one process hold the "
                                      "GPU, and the check runs a build beside its foreground steps")
                return out
            smi_error = (r.stderr or r.stdout).strip()[-300:] or f"exit {r.returncode}"
        except subprocess.TimeoutExpired:
            smi_error = f"no answer in {timeout:.0f} s"
    else:
        smi_error = "not found"
    out: dict = {"source": "torch", "nvidia_smi": smi_error}
    try:
        import torch

        v = torch._C._cuda_getDriverVersion() if torch.cuda.is_available() else 0
        out["cuda_driver_api"] = f"{v // 1000}.{v % 1000 // 10}" if v else None
        out["compute_mode"] = "unknown (no nvidia-smi)"
    except Exception as e:  # noqa: BLE001 - the answer is what could be learned
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def header_check(home: Path | None, timeout: float = 30.0) -> dict:
    """Compile CUDA_HEADERS against HOME/include with the C++ compiler Inductor uses: ok, or the
    missing header."""
    if home is None or not (home / "include").is_dir():
        return {"ok": False, "error": f"no include folder under {home}"}
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if not cxx:
        return {"ok": None, "error": "no C++ compiler (g++ or $CXX) on PATH"}
    src = "".join(f"#include <{h}>\n" for h in CUDA_HEADERS)
    try:
        r = subprocess.run([cxx, "-fsyntax-only", "-x", "c++", "-I", str(home / "include"), "-"], input=src,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"the compiler did not finish in {timeout:.0f} s"}
    if r.returncode == 0:
        return {"ok": True, "headers": list(CUDA_HEADERS)}
    m = re.search(r"fatal error: ([^:\s]+): No such file", r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if "error" in ln]
    return {"ok": False, "missing": m.group(1) if m else None, "error": (lines or [r.stderr.strip()])[0][-300:]}


def wheel_homes() -> list[Path]:
    """The CUDA wheels' single-folder layouts (nvidia/cuNN with an include/ folder) in every
    sys.path entry, in path order: a folder of unpacked wheels put first on PYTHONPATH (the
    carried header wheels) is seen even where site-packages' nvidia/ is a regular package."""
    out, seen = [], set()
    for entry in sys.path:
        base = Path(entry or ".") / "nvidia"
        try:
            subs = sorted(base.iterdir()) if base.is_dir() else []
        except OSError:
            continue
        for d in subs:
            if re.fullmatch(r"cu\d+", d.name) and (d / "include").is_dir() and d.resolve() not in seen:
                seen.add(d.resolve())
                out.append(d)
    return out


def merged_home(folders: list[Path], dest: Path) -> Path:
    """One folder holding the union of `folders` (same cuNN name, several sys.path entries), as
    symlinks per entry of each subfolder (include/, lib/, ...), the first folder's entry winning:
    the layout the image has when pip installs every CUDA wheel into one site-packages."""
    for home in folders:
        for sub in sorted(p for p in home.iterdir() if p.is_dir()):
            (dest / sub.name).mkdir(parents=True, exist_ok=True)
            for entry in sorted(sub.iterdir()):
                link = dest / sub.name / entry.name
                if not link.exists() and not link.is_symlink():
                    link.symlink_to(entry.resolve())
    return dest


def cuda_home(system: Path = Path("/usr/local/cuda"), merge_into: Path | None = None) -> dict:
    """The CUDA_HOME the image's layout gives (the wheels' folder for torch's CUDA major), whether
    its headers compile, and the CUDA_HOME to build with: that folder when they do, else the
    toolkit at `system` when its headers compile (a finding either way), else none. When that
    folder is split over several sys.path entries (carried wheels unpacked beside the installed
    ones) and `merge_into` is given, their union is made there and checked instead."""
    import torch

    major = (torch.version.cuda or "").split(".")[0]
    homes = wheel_homes()
    name = f"cu{major}" if any(h.name == f"cu{major}" for h in homes) else homes[0].name if homes else None
    parts = [h for h in homes if h.name == name]
    wheel = parts[0] if parts else None
    if len(parts) > 1 and merge_into is not None:
        wheel = merged_home(parts, merge_into / name)
    out: dict = {"torch_cuda": torch.version.cuda, "wheel_folders": [str(h) for h in homes],
                 "wheel_home": str(wheel) if wheel else None,
                 **({"merged_from": [str(h) for h in parts]} if len(parts) > 1 and merge_into is not None else {}),
                 "crt": bool(wheel and (wheel / "include" / "crt").is_dir())}
    out["wheel_headers"] = header_check(wheel) if wheel else {"ok": False, "error": "no nvidia/cuNN folder"}
    if out["wheel_headers"].get("ok"):
        out["cuda_home"], out["finding"] = str(wheel), None
        return out
    why = out["wheel_headers"].get("missing") or out["wheel_headers"].get("error")
    out["finding"] = f"the image's CUDA_HOME layout ({wheel or 'no nvidia/cuNN wheel folder'}) cannot compile " \
                     f"AOTInductor's CUDA headers: {why}"
    out["system_home"] = str(system)
    out["system_headers"] = header_check(system)
    out["cuda_home"] = str(system) if out["system_headers"].get("ok") else None
    out["fallback"] = f"building with CUDA_HOME={system}" if out["cuda_home"] else \
        "no CUDA_HOME compiles the headers: the build keeps the environment's"
    return out


class Phases:
    """Seconds of each timed call, by phase, rewritten to `path` after every call."""

    def __init__(self, path: Path):
        self.path, self.t0 = path, time.perf_counter()
        self.doc: dict = {"cuda_home": os.environ.get("CUDA_HOME"), "phases": {}}

    def save(self) -> None:
        ph = self.doc["phases"]
        total = sum(c["s"] for c in ph.get("inductor", []))
        cpp = sum(c["s"] for c in ph.get("cpp_compile", []))
        self.doc["seconds"] = {k: round(sum(c["s"] for c in v), 3) for k, v in ph.items()}
        if "inductor" in ph:            # AOTInductor less its C++ compiler calls, once AOTInductor has ended
            self.doc["seconds"]["lowering"] = round(total - cpp, 3)
        write_atomic(self.path, (json.dumps(self.doc) + "\n").encode())   # whole, fsynced: a kill keeps it

    def timed(self, phase: str, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            t = time.perf_counter()
            rec = {"at": round(t - self.t0, 2)}
            try:
                return fn(*args, **kwargs)
            except BaseException as e:
                rec["error"] = f"{type(e).__name__}: {e}"[:400]
                raise
            finally:
                rec["s"] = round(time.perf_counter() - t, 3)
                self.doc["phases"].setdefault(phase, []).append(rec)
                self.save()
        return run


def build(phases_path: Path, args: list[str]) -> int:
    """engine.build's main with its AOT phases timed; then the .so it wrote loaded once, timed."""
    import torch
    import torch._inductor
    from torch._inductor import cpp_builder

    from engine.backends import aot
    from engine.tuning import main as build_main

    ph = Phases(phases_path)
    aot.export_top1 = ph.timed("export", aot.export_top1)
    torch._inductor.aoti_compile_and_package = ph.timed("inductor", torch._inductor.aoti_compile_and_package)
    if callable(getattr(getattr(cpp_builder, "CppBuilder", None), "build", None)):
        cpp_builder.CppBuilder.build = ph.timed("cpp_compile", cpp_builder.CppBuilder.build)
    else:   # this torch compiles elsewhere: the lowering figure then holds the C++ compile too
        ph.doc["cpp_compile"] = "not separable: torch._inductor.cpp_builder.CppBuilder.build is absent"
    ph.save()
    rc = build_main(args)
    out = Path(args[args.index("--out") + 1]) if "--out" in args else None
    so = out / aot.FILES[0] if out else None
    if rc == 0 and so and so.is_file():
        manifest = json.loads((out / "manifest.json").read_text())
        dev = torch.device(manifest.get("device", "cpu"))
        fn = ph.timed("load", aot.load_in_place)(so, dev)
        shape = (manifest.get(aot.NAME) or {}).get("example_shape")
        if shape:
            try:    # the first call of the loaded graph on a zero batch: its one-time costs
                ph.timed("first_call", first_call)(fn, shape, dev)
            except Exception:  # noqa: BLE001 - recorded in FILE by the timer; the build itself held
                pass
        else:
            ph.doc["first_call"] = "not timed: the manifest names no example shape"
            ph.save()
    return rc


def first_call(fn, shape: list[int], device) -> None:
    """One call of a loaded AOT graph on a zero uint8 batch of the compiled shape, waited for."""
    import torch

    fn(torch.zeros(shape, dtype=torch.uint8, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/device_aot.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("driver", help="driver version and compute mode (nvidia-smi, else torch)")
    h = sub.add_parser("cuda_home", help="the image's CUDA_HOME layout: do its headers compile")
    h.add_argument("--system", type=Path, default=Path("/usr/local/cuda"),
                   help="the CUDA toolkit to fall back to (default: /usr/local/cuda)")
    h.add_argument("--merge-into", type=Path, default=None,
                   help="folder the union of a cuNN folder split over several sys.path entries is made in "
                        "(default: none, the first one is checked)")
    b = sub.add_parser("build", help="engine.build with its AOT phases timed")
    b.add_argument("--phases", type=Path, required=True, help="JSON file the phases are written to")
    b.add_argument("args", nargs=argparse.REMAINDER, help="engine.build's arguments, after --")
    a = p.parse_args(argv)
    if a.what == "build":
        return build(a.phases, a.args[1:] if a.args[:1] == ["--"] else a.args)
    print(json.dumps(driver() if a.what == "driver" else cuda_home(a.system, a.merge_into)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
