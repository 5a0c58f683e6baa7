"""Artifact directories: a manifest.json plus the weights or compiled package it names.

The manifest carries the spec, backend, precision, device, versions and the SHA-256 of
every file and of the source checkpoint. Loading checks it before any image is read.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import settings
from engine.io import package_versions, sha256_file
from engine.spec import Spec

FORMAT = "eva-engine-artifact/1"
MANIFEST = "manifest.json"


class ArtifactError(RuntimeError):
    """The artifact directory is missing, incomplete or corrupt."""


@dataclass(frozen=True)
class Artifact:
    root: Path
    spec: Spec
    backend: str        # a name in engine.backends
    device: str         # cpu | cuda
    precision: str
    batch_size: int
    files: dict[str, dict[str, Any]]   # name -> {"sha256", "bytes"}
    meta: dict[str, Any]               # the whole manifest

    def path(self, name: str) -> Path:
        return self.root / name


def versions() -> dict[str, str | None]:
    return package_versions(("torch", "timm", "nvidia-dali-cuda130", "tensorrt", "torch-tensorrt"))


def write_manifest(root: Path, spec: Spec, backend: str, device: str, checkpoint: Path | None,
                   checkpoint_sha256: str | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Digest every file in `root` and write manifest.json last (its presence marks completion)."""
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[p.relative_to(root).as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    meta = {
        "format": FORMAT,
        "spec": spec.to_dict(),
        "backend": backend,
        "device": device,
        "precision": spec.precision,
        "batch_size": spec.batch_size,
        "checkpoint": None if checkpoint is None else {
            "path": str(checkpoint), "sha256": checkpoint_sha256, "bytes": Path(checkpoint).stat().st_size},
        "files": files,
        "versions": versions(),
        **(extra or {}),
    }
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, root / MANIFEST)
    return meta


def load_artifact(root: str | os.PathLike, verify: str | None = None) -> Artifact:
    """Read and check an artifact. verify: 'sha256' (default) or 'size' (ENGINE_ARTIFACT_VERIFY)."""
    root = Path(root)
    try:
        verify = verify or settings.artifact_verify()
    except ValueError as e:
        raise ArtifactError(str(e)) from None
    if verify not in ("sha256", "size"):
        raise ArtifactError(f"verify must be sha256 or size, got {verify!r}")
    mpath = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(f"artifact directory not found: {root} (build one with python -m engine.build)")
    if not mpath.is_file():
        raise ArtifactError(f"{mpath} is missing: the artifact is incomplete or not an artifact")
    try:
        meta = json.loads(mpath.read_text())
        if meta.get("format") != FORMAT:
            raise ArtifactError(f"{mpath}: format {meta.get('format')!r}, expected {FORMAT!r}")
        spec = Spec.from_dict(meta["spec"])
        files = meta["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise ArtifactError(f"{mpath} is corrupt: {type(e).__name__}: {e}") from e
    for name, info in files.items():
        p = root / name
        if not p.is_file():
            raise ArtifactError(f"artifact file missing: {p}")
        if p.stat().st_size != info["bytes"]:
            raise ArtifactError(f"artifact file {p} has {p.stat().st_size} bytes, manifest says {info['bytes']}")
        if verify == "sha256" and sha256_file(p) != info["sha256"]:
            raise ArtifactError(f"artifact file {p} is corrupt: SHA-256 differs from the manifest")
    return Artifact(root, spec, meta["backend"], meta["device"], meta["precision"],
                    int(meta["batch_size"]), files, meta)
