"""`.provd.json`: a SHA-256 + byte-count manifest of every file in an evidence folder.

The manifest lists every file of its folder (itself excepted) by a path relative to
the folder, so the folder can be moved or archived and still checked. The integrity
is an unauthenticated digest: it detects a changed, missing or extra file; it does
not prove who wrote the folder.

Beside the listing it records two digests of it, each the SHA-256 of the lines
`path<TAB>sha256<TAB>bytes` in path order: `listing_sha256` over every listed file, and
`evidence_sha256` over every file but disclosure.json and report.html, which record that
digest themselves (the disclosure JSON and the HTML show it). Files too large to bundle
(an artifact, an index) are listed under `external` by digest with the command that
rebuilds them; `verify --external DIR` re-checks them against a copy at hand.
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

SCHEMA = "campaign.provd/2"
INTEGRITY = "unauthenticated digest"
MANIFEST_NAME = "campaign.provd.json"
RECORDS_DIGEST = ("disclosure.json", "report.html")  # they carry evidence_sha256, so it cannot cover them
EVIDENCE_COVERS = "every listed file except disclosure.json and report.html, which record this digest"


def listing_sha256(entries: list[dict]) -> str:
    """SHA-256 of `path<TAB>sha256<TAB>bytes` lines, in path order, of manifest entries."""
    lines = "".join(f"{e['path']}\t{e['sha256']}\t{e['bytes']}\n" for e in sorted(entries, key=lambda e: e["path"]))
    return hashlib.sha256(lines.encode()).hexdigest()


def file_entries(folder: Path, skip: tuple[str, ...] = ()) -> list[dict]:
    """{path, sha256, bytes} of every file of folder (the manifest and `skip` excepted)."""
    return [{"path": rel, "sha256": sha256_file(folder / rel), "bytes": (folder / rel).stat().st_size}
            for rel in list_files(folder) if rel not in skip]


def evidence_digest(folder: Path) -> str:
    """evidence_sha256 of folder as it is now: the listing digest of every file but RECORDS_DIGEST."""
    return listing_sha256(file_entries(folder, RECORDS_DIGEST))


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
                   disclosure: str = "disclosure.json", external: list[dict] | None = None) -> Path:
    """Digest every file of folder into folder/campaign.provd.json and return its path.

    `external`: {path, sha256, bytes, rebuild} of files kept out of the folder (too large)."""
    roles = roles or {}
    files = [e | {"role": roles.get(e["path"], "other")} for e in file_entries(folder)]
    manifest = {
        "schema": SCHEMA,
        "integrity": INTEGRITY,
        "disclosure": disclosure,
        "git": {"sha": git.get("sha"), "dirty": git.get("dirty")},
        "listing_sha256": listing_sha256(files),
        "evidence_sha256": listing_sha256([e for e in files if e["path"] not in RECORDS_DIGEST]),
        "evidence_covers": EVIDENCE_COVERS,
        "files": files,
        "external": external or [],
    }
    path = folder / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return path


@dataclass
class VerifyResult:
    checked: int
    problems: list[str]
    external_checked: int = 0
    external_unchecked: int = 0  # listed by digest only, no copy at hand (verify --external DIR)
    evidence_sha256: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def _safe_rel(rel: str) -> bool:
    p = PurePosixPath(rel)
    return bool(rel) and not p.is_absolute() and ".." not in p.parts


def _check_file(path: Path, entry: dict, name: str) -> str | None:
    """Why path does not match its manifest entry, or None."""
    if not path.is_file():
        return f"{name}: missing"
    size = path.stat().st_size
    if size != entry.get("bytes"):
        return f"{name}: changed ({size} bytes, manifest says {entry.get('bytes')})"
    if sha256_file(path) != entry.get("sha256"):
        return f"{name}: changed (sha256 differs from the manifest)"
    return None


def _check_digests(manifest: dict, folder: Path) -> list[str]:
    """The listing digests recomputed from the entries, and the disclosure's own copy of evidence_sha256."""
    files = [e for e in manifest.get("files", []) if isinstance(e, dict) and {"path", "sha256", "bytes"} <= set(e)]
    problems = []
    if manifest.get("listing_sha256") != listing_sha256(files):
        problems.append(f"{MANIFEST_NAME}: listing_sha256 does not match its own listing")
    evidence = manifest.get("evidence_sha256")
    if evidence != listing_sha256([e for e in files if e["path"] not in RECORDS_DIGEST]):
        problems.append(f"{MANIFEST_NAME}: evidence_sha256 does not match its own listing")
    disclosure = folder / manifest.get("disclosure", "disclosure.json")
    try:
        recorded = json.loads(disclosure.read_text()).get("evidence", {}).get("sha256")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if recorded is not None and recorded != evidence:
        problems.append(f"{disclosure.name}: records evidence sha256 {recorded}, the manifest {evidence}")
    return problems


def verify(manifest_path: Path, external_root: Path | None = None) -> VerifyResult:
    """Recompute every leaf relative to the manifest's folder; name each changed, missing or extra file.

    External entries (not bundled) are re-checked under external_root when it is given."""
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
        problem = _check_file(folder / rel, entry, rel)
        if problem:
            problems.append(problem)
    try:
        present = list_files(folder, skip=manifest_path.name)
    except ValueError as exc:
        problems.append(str(exc))
        present = []
    problems += [f"{rel}: extra file not in the manifest" for rel in present if rel not in listed]
    if manifest.get("schema") == SCHEMA:
        problems += _check_digests(manifest, folder)
    external = [e for e in manifest.get("external", []) if isinstance(e, dict)]
    checked = 0
    if external_root is not None:
        for entry in external:
            rel = entry.get("path", "")
            if not _safe_rel(rel):
                problems.append(f"external {rel!r}: path is not relative")
                continue
            problem = _check_file(external_root / rel, entry, f"external {rel}")
            problems += [problem] if problem else []
            checked += 1
    return VerifyResult(checked=len(listed), problems=problems, external_checked=checked,
                        external_unchecked=len(external) - checked, evidence_sha256=manifest.get("evidence_sha256"))


def bundle(src: Path, folder: Path, rel: str, limit_bytes: float, rebuild: str) -> dict:
    """Copy every file of the directory src to folder/rel when together they fit limit_bytes;
    else copy nothing and return their digests (for the manifest's `external`) and the rebuild
    command. Returns {path, bundled, files, bytes, rebuild, external}."""
    import shutil

    entries = file_entries(src, skip=())
    total = sum(e["bytes"] for e in entries)
    record = {"path": rel, "source": str(src), "files": len(entries), "bytes": total, "rebuild": rebuild}
    if total <= limit_bytes:
        for e in entries:
            (folder / rel / e["path"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / e["path"], folder / rel / e["path"])
        return record | {"bundled": True, "external": []}
    return record | {"bundled": False,
                     "external": [e | {"of": rel, "rebuild": rebuild} for e in entries]}


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
