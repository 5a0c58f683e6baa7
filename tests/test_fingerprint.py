"""Comparison fingerprint: stable, canonical, no hostname, allow-listed env only."""

from __future__ import annotations

import hashlib
import json
import platform
import socket

from evaluator.evidence import fingerprint


def test_stable_across_two_calls():
    a, b = fingerprint.collect(), fingerprint.collect()
    assert a == b
    assert fingerprint.fingerprint_sha256(a) == fingerprint.fingerprint_sha256(b)


def test_hash_is_sha256_of_canonical_json():
    fp = fingerprint.collect()
    canonical = json.dumps(fp, sort_keys=True, separators=(",", ":"))
    assert fingerprint.fingerprint_sha256(fp) == hashlib.sha256(canonical.encode()).hexdigest()
    assert fingerprint.fingerprint_sha256({"b": 1, "a": 2}) == fingerprint.fingerprint_sha256({"a": 2, "b": 1})


def test_hostname_is_never_included(monkeypatch):
    monkeypatch.setenv("HOSTNAME", "secret-host-name-xyz")
    text = fingerprint.canonical_json(fingerprint.collect())
    for name in {socket.gethostname(), platform.node(), "secret-host-name-xyz"}:
        if len(name) >= 4:  # a very short name could occur by chance inside other values
            assert name not in text
    assert "hostname" not in text.lower() and '"node"' not in text


def test_keys_present():
    fp = fingerprint.collect()
    cpu = fp["hardware"]["cpu"]
    assert cpu["logical_cores"] >= 1
    assert cpu["memory_total_bytes"] is None or cpu["memory_total_bytes"] > 0
    assert "gpu" in fp["hardware"]  # None when no NVIDIA driver is visible
    sw = fp["software"]
    assert sw["python"]["version"] == platform.python_version()
    assert set(sw["packages"]) >= {"torch", "timm", "numpy", "dali", "tensorrt", "cupy"}
    assert sw["packages"]["numpy"]["version"]
    assert sw["os"]["kernel"] == platform.release()


def test_gpu_is_null_without_driver(monkeypatch):
    monkeypatch.setattr(fingerprint, "_driver_visible", lambda: False)
    assert fingerprint.collect()["hardware"]["gpu"] is None


def test_env_allow_list():
    env = {"OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": "0", "TORCHINDUCTOR_MAX_AUTOTUNE": "1",
           "ENGINE_BACKEND": "trt", "KERNELS_TOPK": "cupy", "ENGINE_ARTIFACT": "/some/path",
           "HOME": "/root", "PATH": "/usr/bin", "HOSTNAME": "box", "AWS_SECRET_ACCESS_KEY": "x"}
    assert fingerprint.perf_env(env) == {"OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": "0",
                                         "TORCHINDUCTOR_MAX_AUTOTUNE": "1", "ENGINE_BACKEND": "trt",
                                         "KERNELS_TOPK": "cupy"}


def test_env_changes_the_hash():
    a = fingerprint.collect({"OMP_NUM_THREADS": "4"})
    b = fingerprint.collect({"OMP_NUM_THREADS": "8"})
    assert fingerprint.fingerprint_sha256(a) != fingerprint.fingerprint_sha256(b)
    assert fingerprint.diff_keys(a, b) == ["env.OMP_NUM_THREADS"]


def test_gpu_from_nvidia_smi(tmp_path, monkeypatch):
    """The nvidia-smi path, with a stand-in nvidia-smi on PATH (no GPU in CI)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 570.86.15, 9.0, 143771, 700.00'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(fingerprint, "_torch_cuda", lambda: None)  # no torch import in this test
    gpu = fingerprint.gpu_info()
    assert gpu == {"nvidia_smi": [{"name": "NVIDIA H200", "driver": "570.86.15", "compute_capability": "9.0",
                                   "memory_mib": 143771, "power_limit_w": "700.00"}], "torch_cuda": None}
