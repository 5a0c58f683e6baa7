"""`.provd.json`: a SHA-256 + byte-count manifest of every file in an evidence folder.

The manifest lists every file of its folder (itself excepted) by a path relative to
the folder, so the folder can be moved or archived and still checked. The integrity
is an unauthenticated digest: it detects a changed, missing or extra file; it does
not prove who wrote the folder.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from engine.io import sha256_file

SCHEMA = "campaign.provd/1"
INTEGRITY = "unauthenticated digest"
MANIFEST_NAME = "campaign.provd.json"


def tree_digest(root: Path) -> dict:
    """Digest of every file under root: {"sha256": combined, "files": {relpath: sha256}}."""
    files = {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}
    combined = hashlib.sha256("".join(f"{k}\t{v}\n" for k, v in files.items()).encode()).hexdigest()
    return {"sha256": combined, "files": files}


def list_files(folder: Path, skip: str | None = MANIFEST_NAME) -> list[str]:
    """Every regular file under folder as a sorted POSIX path relative to it."""
    out = []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder).as_posix()
        if rel == skip:
            continue
        if p.is_symlink():
            raise ValueError(f"{rel}: symbolic links are not allowed in an evidence folder")
        if p.is_file():
            out.append(rel)
    return sorted(out)


def write_manifest(folder: Path, git: dict, roles: dict[str, str] | None = None,
                   disclosure: str = "disclosure.json") -> Path:
    """Digest every file of folder into folder/campaign.provd.json and return its path."""
    roles = roles or {}
    files = [
        {"path": rel, "sha256": sha256_file(folder / rel), "bytes": (folder / rel).stat().st_size,
         "role": roles.get(rel, "other")}
        for rel in list_files(folder)
    ]
    manifest = {
        "schema": SCHEMA,
        "integrity": INTEGRITY,
        "disclosure": disclosure,
        "git": {"sha": git.get("sha"), "dirty": git.get("dirty")},
        "files": files,
    }
    path = folder / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return path


@dataclass
class VerifyResult:
    checked: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def _safe_rel(rel: str) -> bool:
    p = PurePosixPath(rel)
    return bool(rel) and not p.is_absolute() and ".." not in p.parts


def verify(manifest_path: Path) -> VerifyResult:
    """Recompute every leaf relative to the manifest's folder; name each changed, missing or extra file."""
    folder = manifest_path.resolve().parent
    manifest = json.loads(manifest_path.read_text())
    problems = []
    if manifest.get("integrity") != INTEGRITY:
        problems.append(f"{manifest_path.name}: integrity field is {manifest.get('integrity')!r}, expected {INTEGRITY!r}")
    listed = set()
    for entry in manifest.get("files", []):
        rel = entry.get("path", "")
        if not _safe_rel(rel):
            problems.append(f"{rel!r}: path is not relative to the manifest's folder")
            continue
        listed.add(rel)
        path = folder / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
            continue
        size = path.stat().st_size
        if size != entry.get("bytes"):
            problems.append(f"{rel}: changed ({size} bytes, manifest says {entry.get('bytes')})")
        elif sha256_file(path) != entry.get("sha256"):
            problems.append(f"{rel}: changed (sha256 differs from the manifest)")
    try:
        present = list_files(folder, skip=manifest_path.name)
    except ValueError as exc:
        problems.append(str(exc))
        present = []
    problems += [f"{rel}: extra file not in the manifest" for rel in present if rel not in listed]
    return VerifyResult(checked=len(listed), problems=problems)


def package(folder: Path, out: Path) -> Path:
    """Write folder as a reproducible tar.gz (sorted names, zeroed owners and times)."""
    folder = folder.resolve()
    out = out.resolve()
    if out.is_relative_to(folder):
        raise ValueError(f"{out}: the archive must be written outside the folder it packs")
    names = list_files(folder)
    if (folder / MANIFEST_NAME).exists():
        names.insert(0, MANIFEST_NAME)
    with open(out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in names:
            info = tar.gettarinfo(str(folder / rel), arcname=f"{folder.name}/{rel}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            info.mode = 0o644
            with open(folder / rel, "rb") as f:
                tar.addfile(info, f)
    return out


def extract(archive: Path, dest: Path) -> Path:
    """Extract a package made by package() into dest; return the evidence folder inside it."""
    with tarfile.open(archive, "r:gz") as tar:
        names = {m.name.split("/", 1)[0] for m in tar.getmembers()}
        tar.extractall(dest, filter="data")
    if len(names) != 1:
        raise ValueError(f"{archive}: expected one top-level folder, found {sorted(names)}")
    return dest / names.pop()


def relpath(path: Path, folder: Path) -> str:
    """POSIX path of path relative to folder."""
    return Path(os.path.relpath(path, folder)).as_posix()
