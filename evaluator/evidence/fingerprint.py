"""Comparison fingerprint: the hardware and software keys that decide a timing.

Two timings compare only when their fingerprints are equal. The fingerprint is the
SHA-256 of the canonical JSON (sort_keys, separators (',', ':')) of
`{"hardware": ..., "software": ..., "env": ...}`. The hostname, serial numbers, GPU
UUIDs and paths are never part of it: they identify a machine, not its performance.

Nothing heavy is imported here: package versions come from importlib.metadata, and
torch.cuda is only asked (in a short child process, so this process holds no CUDA
context while the timed runs execute) when an NVIDIA driver is visible.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

# Performance-relevant environment variables, by exact name.
ENV_ALLOW = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "CUDA_LAUNCH_BLOCKING",
    "CUDA_MODULE_LOADING",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "PYTORCH_CUDA_ALLOC_CONF",
    "NVIDIA_TF32_OVERRIDE",
    "TIMM_FUSED_ATTN",
    "TOKENIZERS_PARALLELISM",
)
# ... and by prefix (engine switches, kernel switches, compiler knobs, DALI knobs).
ENV_ALLOW_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "ENGINE_", "KERNELS_", "DALI_", "TRT_")
# Paths and clocks, not settings: they differ between runs without changing performance.
ENV_EXCLUDE = ("ENGINE_ARTIFACT", "ENGINE_T0", "TORCHINDUCTOR_CACHE_DIR")

# Distribution name patterns (fnmatch, first hit wins) for each software key.
PACKAGES = {
    "torch": ("torch",),
    "timm": ("timm",),
    "numpy": ("numpy",),
    "dali": ("nvidia-dali-cuda*", "nvidia-dali*"),
    "tensorrt": ("tensorrt", "tensorrt-cu[0-9][0-9]"),
    "cupy": ("cupy", "cupy-cuda*"),
    "open_clip": ("open-clip-torch",),
}

_TORCH_GPU_QUERY = """
import json, torch
out = {"cuda_available": torch.cuda.is_available(), "cuda_runtime": torch.version.cuda, "devices": []}
if out["cuda_available"]:
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out["devices"].append({"name": p.name, "compute_capability": f"{p.major}.{p.minor}",
                               "memory_bytes": p.total_memory, "multiprocessors": p.multi_processor_count})
print(json.dumps(out))
"""


def canonical_json(obj: Any) -> str:
    """The canonical form that is hashed: sorted keys, no whitespace."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def fingerprint_sha256(fp: dict) -> str:
    """SHA-256 hex of the canonical JSON of a fingerprint dict."""
    return hashlib.sha256(canonical_json(fp).encode()).hexdigest()


def _lscpu() -> dict[str, str]:
    if shutil.which("lscpu") is None:
        return {}
    proc = subprocess.run(["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}, check=False)
    fields = {}
    for line in proc.stdout.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def _cpuinfo() -> tuple[str | None, int | None, int | None]:
    """(model name, physical cores, sockets) from /proc/cpuinfo, None where absent (ARM)."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return None, None, None
    model, cores, sockets, phys = None, set(), set(), None
    for line in path.read_text(errors="replace").splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and model is None:
            model = value
        elif key == "physical id":
            phys = value
            sockets.add(value)
        elif key == "core id":
            cores.add((phys, value))
    return model, (len(cores) or None), (len(sockets) or None)


def _mem_total_bytes() -> int | None:
    path = Path("/proc/meminfo")
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024  # reported in kB
    return None


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def cpu_info() -> dict:
    """CPU model, logical/physical cores, sockets, usable cores (affinity), memory."""
    lscpu = _lscpu()
    model, physical, sockets = _cpuinfo()
    model = model or lscpu.get("Model name") or platform.processor() or None
    if sockets is None:
        sockets = _int_or_none(lscpu.get("Socket(s)"))
    per_socket = _int_or_none(lscpu.get("Core(s) per socket"))
    if physical is None and per_socket and sockets:
        physical = per_socket * sockets
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "model": model,
        "architecture": platform.machine(),
        "logical_cores": os.cpu_count(),
        "physical_cores": physical,
        "sockets": sockets,
        "usable_cores": usable,
        "memory_total_bytes": _mem_total_bytes(),
    }


def _nvidia_smi() -> list[dict] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    query = "name,driver_version,compute_cap,memory.total,power.limit"
    proc = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    if proc.returncode != 0:
        print(f"fingerprint: nvidia-smi failed ({proc.returncode}): {proc.stderr.strip()}", file=sys.stderr)
        return None
    gpus = []
    for line in proc.stdout.strip().splitlines():
        name, driver, cc, mem, power = (part.strip() for part in line.split(","))
        gpus.append({"name": name, "driver": driver, "compute_capability": cc,
                     "memory_mib": _int_or_none(mem), "power_limit_w": power})
    return gpus


def _torch_cuda() -> dict | None:
    proc = subprocess.run([sys.executable, "-c", _TORCH_GPU_QUERY], capture_output=True, text=True,
                          timeout=300, check=False)
    if proc.returncode != 0:
        print(f"fingerprint: torch.cuda query failed: {proc.stderr.strip()[-500:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout)


def _driver_visible() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia").exists()


def gpu_info() -> dict | None:
    """GPU name/driver/compute capability/memory, or None when no NVIDIA driver is visible."""
    if not _driver_visible():
        return None
    smi = _nvidia_smi()
    torch_cuda = _torch_cuda() if importlib.util.find_spec("torch") is not None else None
    if not smi and not (torch_cuda and torch_cuda["devices"]):
        return None
    return {"nvidia_smi": smi, "torch_cuda": torch_cuda}


def _installed() -> dict[str, str]:
    """Lower-cased distribution name -> version, for every installed distribution."""
    out = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name and name not in out:
            out[name] = dist.version
    return out


def package_versions() -> dict[str, dict | None]:
    """{key: {"dist": name, "version": v} | None} for each key of PACKAGES."""
    installed = _installed()
    versions: dict[str, dict | None] = {}
    for key, patterns in PACKAGES.items():
        hits = [name for pattern in patterns for name in sorted(fnmatch.filter(installed, pattern))]
        versions[key] = {"dist": hits[0], "version": installed[hits[0]]} if hits else None
    return versions


def os_info() -> dict:
    pretty = None
    release = Path("/etc/os-release")
    if release.exists():
        for line in release.read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                pretty = line.split("=", 1)[1].strip('"')
    return {"system": platform.system(), "kernel": platform.release(), "distribution": pretty}


def perf_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The allow-listed performance environment variables that are set."""
    environ = dict(os.environ if environ is None else environ)
    return {
        k: v for k, v in sorted(environ.items())
        if k not in ENV_EXCLUDE and (k in ENV_ALLOW or k.startswith(ENV_ALLOW_PREFIXES))
    }


def collect(environ: dict[str, str] | None = None) -> dict:
    """The full fingerprint dict (hash it with fingerprint_sha256)."""
    return {
        "hardware": {"cpu": cpu_info(), "gpu": gpu_info()},
        "software": {
            "os": os_info(),
            "python": {"version": platform.python_version(), "implementation": platform.python_implementation()},
            "packages": package_versions(),
        },
        "env": perf_env(environ),
    }


def diff_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two fingerprints."""
    keys = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            keys += diff_keys(va, vb, f"{prefix}{k}.")
        elif va != vb:
            keys.append(f"{prefix}{k}")
    return keys


if __name__ == "__main__":
    fp = collect()
    print(json.dumps({"fingerprint_sha256": fingerprint_sha256(fp), "fingerprint": fp}, indent=2))
